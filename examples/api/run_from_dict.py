"""A whole megaforge run configured by a Python dict (no YAML file): the CPU demo's task, a short SFT
warm start, then GRPO. The same as ``python launchers/grpo.py --config ...`` with these keys.

    python examples/api/run_from_dict.py [OUTPUT_DIR]      # writes OUTPUT_DIR/api_dict/ (default runs/)
"""
import os
import sys

import megaforge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = {
    "run_name": "api_dict",
    "max_steps": 20,
    "model": {"config": os.path.join(ROOT, "configs", "models", "tiny-qwen2"),  # a seeded random init
              "tokenizer": os.path.join(ROOT, "assets", "tiny-tokenizer")},
    "data": {"path": "arithmetic", "format": "synthetic",
             "synthetic_kwargs": {"max_operand": 9, "ops": "+", "boxed_fraction": 0.3}, "max_prompt_len": 64},
    "sft": {"max_steps": 100, "batch_size": 64, "lr": 3.0e-3},
    "grpo": {"n_samples": 8},
    "rewards": {"functions": [{"name": "math", "weight": 0.9}, {"name": "thinking", "weight": 0.1}]},
    "rollout": {"engine": "embedded", "batch_size": 32, "max_new_tokens": 24},
    "trainer": {"backend": "torch", "lr": 3.0e-4, "micro_batch_size": 128},
}


def main(output_dir: str = "runs", **overrides) -> list[float]:
    """Run CONFIG (plus ``overrides``: dotted keys, e.g. ``{"max_steps": 2}``) under ``output_dir``;
    returns the reward/mean of every RL step."""
    cfg = megaforge.load_config(CONFIG, {"output_dir": output_dir, **overrides})
    run = megaforge.run_grpo(cfg)
    import json

    with open(os.path.join(run.run_dir, "metrics.jsonl")) as f:
        rewards = [json.loads(line)["reward/mean"] for line in f if line.strip()]
    print(f"{run.run_dir}: reward/mean {rewards[0]:.3f} -> {rewards[-1]:.3f} over {len(rewards)} RL steps")
    return rewards


if __name__ == "__main__":
    main(*sys.argv[1:2])
