"""Plug-ins of the fault tests (imported by name through the config, as a user's own module)."""


def length_reward(prompt: str, response: str, target) -> float:
    """Never constant on the random demo model, so every RL step has a gradient and changes the
    weights (a restarted engine re-synced to stale weights would change the next steps' metrics)."""
    return len(response) / 100.0


def hang_on_label(prompt: str, response: str, target) -> float:
    """Never returns for rows labelled ``hang`` (a reward stuck in a call); else the length reward."""
    import time

    while target == "hang":
        time.sleep(3600)
    return length_reward(prompt, response, target)


def always_raises(prompt: str, response: str, target) -> float:
    raise ConnectionError("reward service unreachable")
