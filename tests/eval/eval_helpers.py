"""Helpers of the evaluation tests: a reward that is never constant on the tiny random model, and
launcher runs of the CPU demo with an ``eval:`` section."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from run_helpers import lines, run_in_process, stable  # noqa: E402,F401  (re-exported)

DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--config", DEMO, "--sft.max_steps", "2", "--sft.batch_size", "8", "--rollout.batch_size", "4",
        "--grpo.n_samples", "4", "--rollout.max_new_tokens", "10", "--metrics.progress", "false",
        "--metrics.tensorboard", "false", "--metrics.log_samples", "0", "--deterministic", "true",
        "--rollout.device", "cpu",
        "--rewards.functions", "[{name: 'eval_helpers:even_length', weight: 1.0}, {name: math, weight: 0.5}]"]
EVAL = ["--eval.sets", "[{name: held, holdout: 0.2, max_rows: 6}]", "--eval.before_train", "true",
        "--eval.n_samples", "4", "--eval.pass_k", "[1, 2, 4]", "--eval.correct_reward", "eval_helpers:even_length"]


def even_length(prompt: str, response: str, target) -> float:
    """1 when the response has an even number of characters: about half the random model's responses."""
    return float(len(response) % 2 == 0)


def even_length_stopping(prompt: str, response: str, target) -> float:
    """``even_length``, and once: SIGTERM to the run (this reward worker's parent process) on the first
    call that finds ``MF_TEST_STOP_ROWS=<metrics.jsonl>:<n>`` holding n rows. Rewards of step s are
    scored before its row is written, so the signal lands inside step n - 1's rollout scoring whatever
    the timing (with eval.before_train, row 0 is the starting policy's evaluation)."""
    spec = os.environ.get("MF_TEST_STOP_ROWS")
    if spec:
        path, n = spec.rsplit(":", 1)
        fired = path + ".stop_sent"
        if not os.path.exists(fired) and len(lines(path)) >= int(n):
            open(fired, "w").close()
            os.kill(os.getppid(), signal.SIGTERM)
    return even_length(prompt, response, target)


def even_length_stop_in_eval(prompt: str, response: str, target) -> float:
    """``even_length``, and once: SIGTERM to the run (this reward worker's parent process) when it scores
    a response to a row labelled ``STOP`` (rows only the evaluation set has) and
    ``MF_TEST_STOP_IN_EVAL=<marker file>`` does not exist yet (it is created then). The signal lands
    inside the evaluation's first engine call's scoring, whatever the timing."""
    marker = os.environ.get("MF_TEST_STOP_IN_EVAL")
    if marker and target == "STOP" and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getppid(), signal.SIGTERM)
    return even_length(prompt, response, target)


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join([ROOT, HERE]))


def launch(out: str, name: str, *extra, timeout: int = 600) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), *TINY, "--output_dir", out,
           "--run_name", name, *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return lines(os.path.join(out, name, "metrics.jsonl"))


def launch_here(out: str, name: str, *extra) -> list[dict]:
    """:func:`launch` in this process (run_helpers.run_in_process: no new interpreter's imports)."""
    rc, stdout, stderr = run_in_process("grpo", [*TINY, "--output_dir", out, "--run_name", name, *extra])
    assert rc == 0, stdout[-3000:] + stderr[-3000:]
    return lines(os.path.join(out, name, "metrics.jsonl"))


def eval_part(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k.startswith("eval/")}


def train_part(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith(("eval/", "time/", "throughput/"))}


def samples(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]
