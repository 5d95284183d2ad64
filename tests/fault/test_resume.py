"""Exact resume: a run stopped by SIGTERM (or killed with SIGKILL) anywhere and resumed with --resume
writes the same metrics.jsonl values as an uninterrupted run; corrupt checkpoints are skipped.
The runs that get a signal are processes of their own; the others (the reference, the resumes, the
corrupt-checkpoint runs) run in this process (run_helpers.run_in_process: no new interpreter's imports)."""
import os
import signal
import subprocess
import sys

import pytest
from run_helpers import lines, run_in_process, stable, stop_when

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
ARGS = ["--config", DEMO, "--sft.max_steps", "6", "--sft.batch_size", "8", "--rollout.batch_size", "4",
        "--grpo.n_samples", "4", "--rollout.max_new_tokens", "12", "--max_steps", "6", "--grpo.beta", "0.01",
        "--metrics.progress", "false", "--metrics.tensorboard", "false", "--deterministic", "true"]


def cmd(out, name, *extra):
    return [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), *ARGS, "--output_dir", out, "--run_name", name, *extra]


def here(out, name, *extra) -> str:
    """The run in this process (it must exit 0); its stdout."""
    rc, stdout, stderr = run_in_process("grpo", [*ARGS, "--output_dir", out, "--run_name", name, *extra])
    assert rc == 0, stdout[-2000:] + stderr[-2000:]
    return stdout


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref"))
    here(out, "r")
    run = os.path.join(out, "r")
    return lines(os.path.join(run, "metrics.jsonl")), lines(os.path.join(run, "sft_metrics.jsonl"))


# in RL (slow, ~10 s): a SIGTERM inside an RL step, its checkpoint and the exact resume are also
# tests/eval/test_eval_run.py::test_eval_rows_samples_and_resume's (default run); in SFT: here only
@pytest.mark.parametrize("where,n", [pytest.param("metrics.jsonl", 2, marks=pytest.mark.slow), ("sft_metrics.jsonl", 3)])
def test_sigterm_then_resume_matches_uninterrupted(tmp_path, reference, where, n):
    out = str(tmp_path)
    run = os.path.join(out, "s")
    p = subprocess.Popen(cmd(out, "s"), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rc = stop_when(p, os.path.join(run, where), n, signal.SIGTERM)
    assert rc == 143, p.stderr.read()[-2000:]
    assert "received: stopped after" in p.stderr.read()
    here(out, "s", "--resume")
    rl, sft = reference
    assert stable(lines(os.path.join(run, "metrics.jsonl"))) == stable(rl)
    assert stable(lines(os.path.join(run, "sft_metrics.jsonl"))) == stable(sft)


def test_sigkill_resumes_from_last_checkpoint(tmp_path, reference):
    out = str(tmp_path)
    run = os.path.join(out, "k")
    p = subprocess.Popen(cmd(out, "k", "--checkpoint.interval", "2"), env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    stop_when(p, os.path.join(run, "metrics.jsonl"), 3, signal.SIGKILL)
    stdout = here(out, "k", "--resume", "--checkpoint.interval", "2")  # the killed run's lock is left behind
    assert "resumed from" in stdout and "step_000002" in stdout
    assert stable(lines(os.path.join(run, "metrics.jsonl"))) == stable(reference[0])


def test_corrupt_checkpoint_falls_back(tmp_path):
    out = str(tmp_path)
    run = os.path.join(out, "c")
    short = ["--max_steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_last_n", "3"]
    here(out, "c", *short)
    ckpts = os.path.join(run, "checkpoints")
    newest = os.path.join(ckpts, "step_000004", "trainer", "trainer.pt")
    with open(newest, "r+b") as f:  # truncate the newest checkpoint's weights
        f.truncate(os.path.getsize(newest) // 2)
    before = os.listdir(run)
    stdout = here(out, "c", *short[:1], "6", *short[2:], "--resume")
    assert "step_000004 is not usable (trainer/trainer.pt:" in stdout
    assert "resumed from" in stdout and "step_000002" in stdout
    assert [r["step"] for r in lines(os.path.join(run, "metrics.jsonl"))] == [1, 2, 3, 4, 5, 6]
    # the first attempt's steps 3-4, which the resume from step 2 ran again, are kept aside
    assert [r["step"] for r in lines(os.path.join(run, "metrics.superseded.jsonl"))] == [3, 4]
    assert set(before) <= set(os.listdir(run))


@pytest.mark.slow  # ~30 s, 3 runs; the pruning that protects the resumed-from checkpoint: tests/test_checkpoint.py; the fallback in a run: test_corrupt_checkpoint_falls_back
def test_prune_after_fallback_keeps_a_resumable_checkpoint(tmp_path, reference):
    """The newest checkpoint is corrupt; the resumed run falls back, completes and prunes to
    keep_last_n 1: it must keep the checkpoint it resumed from and its own (the old pruning kept
    the highest step number, the corrupt one, and deleted both: the next --resume started from
    scratch)."""
    out = str(tmp_path)
    run = os.path.join(out, "p")
    ckpts = os.path.join(run, "checkpoints")
    subprocess.run(cmd(out, "p", "--max_steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_last_n", "2"),
                   env=env(), check=True, capture_output=True, timeout=300)
    assert sorted(os.listdir(ckpts)) == ["step_000002", "step_000004"]
    f = os.path.join(ckpts, "step_000004", "trainer", "trainer.pt")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    keep1 = ["--checkpoint.interval", "2", "--checkpoint.keep_last_n", "1", "--resume"]
    p = subprocess.run(cmd(out, "p", "--max_steps", "3", *keep1), env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resumed from" in p.stdout and "step_000002" in p.stdout
    assert sorted(os.listdir(ckpts)) == ["step_000002", "step_000003"]  # a completed run ends resumable
    p = subprocess.run(cmd(out, "p", "--max_steps", "4", *keep1), env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"resumed from {os.path.join(ckpts, 'step_000003')}" in p.stdout
    assert sorted(os.listdir(ckpts)) == ["step_000003", "step_000004"]
    assert stable(lines(os.path.join(run, "metrics.jsonl"))) == stable(reference[0][:4])
