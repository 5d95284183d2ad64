"""An RL loop written by hand with megaforge's pieces: generate -> score -> train_step -> push_weights,
on the CPU demo's config (the run folder, SFT warm start, engine, rewards and data set up by
``megaforge.Session``), then the trained policy asked a question of your own.

    python examples/api/manual_loop.py [OUTPUT_DIR]        # writes OUTPUT_DIR/api_manual/ (default runs/)
"""
import os
import sys

import megaforge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(output_dir: str = "runs", steps: int = 10, **overrides) -> list[dict]:
    """``steps`` hand-written RL steps; returns each step's metrics (reward, loss, ...)."""
    cfg = megaforge.load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), {
        "output_dir": output_dir, "run_name": "api_manual", "max_steps": steps, "sft.max_steps": 100,
        "metrics.progress": False, "model.config": os.path.join(ROOT, "configs", "models", "tiny-qwen2"),
        "model.tokenizer": os.path.join(ROOT, "assets", "tiny-tokenizer"), **overrides})
    history = []
    with megaforge.Session(cfg) as s:  # run folder, trainer, SFT warm start, engine, rewards, data
        for step in range(1, steps + 1):
            samples = s.generate()           # rollout.batch_size prompts of data.path x grpo.n_samples
            rewards = s.score(samples)       # sets each sample.reward
            m = s.train_step(samples)        # advantages, log-probs, optimizer step(s)
            s.push_weights()                 # the engine now serves the updated policy
            history.append({**rewards, **m})
            print(f"step {step}: reward {rewards['reward/mean']:.3f}  loss {m['loss']:.4f}  "
                  f"grad_norm {m['grad_norm']:.3f}")
        mine = s.generate(["What is 4 + 3?"], labels=["7"])  # your own prompt, grpo.n_samples answers
        s.score(mine)
        for x in mine[:3]:
            print(f"{x.response_text!r}: reward {x.reward:.2f}")
    return history


if __name__ == "__main__":
    main(*sys.argv[1:2])
