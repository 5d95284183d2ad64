"""Reward plug-in of the LoRA run tests (``name: 'lora_plugins:length_reward'``)."""


def length_reward(prompt: str, response: str, target) -> float:
    """Never constant on a random tiny model, so every RL step has a gradient and moves the adapters."""
    return len(response) / 100.0
