"""Launcher runs of the CPU demo for the loop tests (tiny settings, one process, CPU): :func:`launch` in the
test's process (run_helpers.run_in_process), :func:`cmd` for a run that must be a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys

from run_helpers import lines, run_in_process, stable, stop_when  # noqa: F401  (re-exported to the loop tests)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--config", DEMO, "--sft.max_steps", "3", "--sft.batch_size", "8", "--rollout.batch_size", "4",
        "--grpo.n_samples", "4", "--rollout.max_new_tokens", "12", "--metrics.progress", "false",
        "--metrics.tensorboard", "false", "--metrics.log_samples", "0"]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")


def cmd(out: str, name: str, *extra) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), *TINY, "--output_dir", out, "--run_name", name,
            *extra]


def launch(out: str, name: str, *extra) -> list[dict]:
    """The run in this process (no new interpreter's imports: ~1.5 s instead of ~7 s); its metrics."""
    rc, stdout, stderr = run_in_process("grpo", [*TINY, "--output_dir", out, "--run_name", name, *extra])
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    return lines(os.path.join(out, name, "metrics.jsonl"))
