"""End-to-end runs of the launcher on tiny settings: run directory, metrics, checkpoints, resume.
Runs whose process the test does not need (the refused second run, the resume, the bfloat16 engine) run
in the test's (run_helpers.run_in_process: the launcher's main without a new interpreter's imports)."""
import json
import os
import subprocess
import sys

import pytest
from run_helpers import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--sft.max_steps", "3", "--sft.batch_size", "8", "--rollout.batch_size", "4", "--grpo.n_samples", "4",
        "--rollout.max_new_tokens", "12", "--metrics.progress", "false"]


def launch(*args, expect_rc=0, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), "--config", DEMO, *TINY, *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == expect_rc, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def here(*args, expect_rc=0):
    """:func:`launch` in this process; (stdout, stderr)."""
    rc, out, err = run_in_process("grpo", ["--config", DEMO, *TINY, *args])
    assert rc == expect_rc, out[-3000:] + err[-3000:]
    return out, err


def metrics(run_dir, name="metrics.jsonl"):
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(l) for l in f]


def test_run_dir_metrics_and_resume(tmp_path):
    out = str(tmp_path)
    launch("--output_dir", out, "--run_name", "a", "--max_steps", "4", "--checkpoint.interval", "2")
    run = os.path.join(out, "a")
    recs = metrics(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    from megaforge.metrics import REQUIRED_KEYS

    for k in REQUIRED_KEYS:
        assert k in recs[0], k
    assert [r["compile/new_graphs"] for r in recs] == [0.0] * 4  # nothing compiles on the CPU
    assert len(metrics(run, "sft_metrics.jsonl")) == 3
    assert os.path.exists(os.path.join(run, "config.yaml"))
    assert os.listdir(os.path.join(run, "tensorboard"))
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_000002", "step_000004"]

    # a second run into the same directory without --resume is refused and changes nothing
    before = open(os.path.join(run, "metrics.jsonl")).read()
    _, err = here("--output_dir", out, "--run_name", "a", "--max_steps", "4", expect_rc=1)
    assert "already holds a run: pass --resume" in err
    assert open(os.path.join(run, "metrics.jsonl")).read() == before

    # resume continues from step 4 to 6 with no duplicated step
    here("--output_dir", out, "--run_name", "a", "--max_steps", "6", "--resume", "--checkpoint.interval", "2")
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_config_error_before_any_work(tmp_path):
    p = launch("--output_dir", str(tmp_path), "--grpo.n_sample", "2", expect_rc=2)
    assert "did you mean 'grpo.n_samples'" in p.stderr
    assert os.listdir(tmp_path) == []


def test_wandb_offline_and_plot(tmp_path):
    pytest.importorskip("wandb")
    out = str(tmp_path)
    launch("--output_dir", out, "--run_name", "w", "--max_steps", "2", "--sft.max_steps", "0",
           "--metrics.wandb", "true", "--metrics.wandb_mode", "offline")
    run = os.path.join(out, "w")
    wb = os.path.join(run, "wandb")
    assert any(d.startswith("offline-run-") for d in os.listdir(wb)), os.listdir(wb)
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_run.py"), run], check=True, env=env,
                   capture_output=True, timeout=120)
    with open(os.path.join(run, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bfloat16_engine_beside_a_float32_autocast_trainer(tmp_path):
    """rollout.dtype bfloat16 with a float32 trainer under bfloat16 autocast: the engine's log-probs are
    another model's numerics, the PPO ratio's pi_old is the trainer's own (its detached log-probs for
    one update per batch), so the ratio is 1 (up to the mean's float32 rounding over the tokens)."""
    out = str(tmp_path)
    here("--output_dir", out, "--run_name", "bf", "--max_steps", "2", "--sft.max_steps", "0",
         "--rollout.dtype", "bfloat16", "--trainer.autocast", "bfloat16")
    rows = metrics(os.path.join(out, "bf"))
    assert len(rows) == 2
    for r in rows:
        assert abs(r["ratio"] - 1.0) < 1e-6, r["ratio"]
        assert r["train_rollout_logprob_abs_diff"] > 1e-5  # the engine really is another model (bfloat16)
