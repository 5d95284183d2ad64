"""Runs and their files: non-finite weights never reach a checkpoint, a full disk is named with
its cause and leaves no partial checkpoint, one run directory has one writer at a time, and a
worker dies with its torchrun agent. The runs that need no process of their own run in the test's
(run_helpers.run_in_process)."""
import os
import signal
import subprocess
import sys
import time

import pytest
from run_helpers import completed_in_process, lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--config", DEMO, "--sft.max_steps", "0", "--rollout.batch_size", "2", "--grpo.n_samples", "2",
        "--rollout.max_new_tokens", "8", "--metrics.progress", "false", "--metrics.tensorboard", "false"]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.path.dirname(__file__))


def here(out, name, *extra):
    """The run in this process (``subprocess.CompletedProcess``)."""
    return completed_in_process("grpo", [*TINY, "--output_dir", str(out), "--run_name", name, *extra])


def cmd(out, name, *extra, torchrun=False):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"] if torchrun else [sys.executable]
    return [*launcher, os.path.join(ROOT, "launchers", "grpo.py"), *TINY, "--output_dir", str(out), "--run_name", name,
            *extra]


def test_non_finite_weights_stop_the_run_and_are_not_written(tmp_path):
    """Weights that hold inf after a step (injected: tests/fault/inf_weights.py): the run stops
    naming the tensor instead of writing it into the checkpoint (trainer.lr .inf used to exit 0
    with 51 non-finite tensors there); .inf itself is a config error now."""
    # a process of its own: the plug-in patches TorchTrainer.train_step for the life of the process
    p = subprocess.run(cmd(tmp_path, "n", "--max_steps", "1", "--algo.plugins", "[inf_weights]"), env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert ("megaforge: error: RL step 1: 1 weight tensor(s) hold NaN or inf (rank 0: "
            "model.model.layers.0.mlp.up_proj.weight); no checkpoint was written") in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert os.listdir(tmp_path / "n" / "checkpoints") == []  # no step_, no .tmp-
    assert [r["step"] for r in lines(os.path.join(tmp_path, "n", "metrics.jsonl"))] == [1]  # what was logged stays
    p = here(tmp_path, "inf", "--trainer.lr", ".inf")
    assert p.returncode == 2 and "config key 'trainer.lr': expected a finite number, got inf" in p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (tests/test_checkpoint.py injects ENOSPC)")
def test_full_disk_names_the_checkpoint_and_the_cause(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        p = here(mnt, "d", "--max_steps", "1")
        assert p.returncode == 1, p.stderr[-3000:]
        ckpt = os.path.join(mnt, "d", "checkpoints", "step_000001")
        assert f"megaforge: error: RL step 1: writing checkpoint {ckpt} failed: No space left on device (ENOSPC)" \
               in p.stderr, p.stderr[-3000:]
        assert "Traceback" not in p.stderr and "basic_ios" not in p.stderr
        assert os.listdir(os.path.join(mnt, "d", "checkpoints")) == []  # the .tmp- folder was removed
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _wait_for_metrics(path, proc, timeout=300):
    deadline = time.time() + timeout
    while not lines(path):
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else "the run ended"
        assert time.time() < deadline, "no metrics"
        time.sleep(0.2)


def test_a_second_process_cannot_write_a_run_directory(tmp_path):
    run = tmp_path / "l"
    first = subprocess.Popen(cmd(tmp_path, "l", "--max_steps", "200"), env=env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_metrics(str(run / "metrics.jsonl"), first)
        second = here(tmp_path, "l", "--max_steps", "200", "--resume")
        assert second.returncode == 1
        assert f"run directory {run} is in use by process {first.pid}@" in second.stderr, second.stderr[-3000:]
        assert first.poll() is None  # the holder was not disturbed (the next test resumes a freed directory)
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=300) == 143


def _children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(p))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_worker_dies_with_its_torchrun_agent(tmp_path):
    """SIGKILL to torchrun's agent: its worker used to train on, orphaned (and write the run
    directory while a --resume did); now it gets SIGKILL too, and the resume can take the lock."""
    run = tmp_path / "o"
    agent = subprocess.Popen(cmd(tmp_path, "o", "--max_steps", "200", torchrun=True), env=env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_metrics(str(run / "metrics.jsonl"), agent)
    workers = _children(agent.pid)
    assert workers, "torchrun has no worker"
    agent.kill()
    agent.wait()
    deadline = time.time() + 20
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers), "the worker outlived its agent"
    n = len(lines(str(run / "metrics.jsonl")))
    time.sleep(2)
    assert len(lines(str(run / "metrics.jsonl"))) == n  # nobody writes the run any more
    again = subprocess.run(cmd(tmp_path, "o", "--max_steps", "1", "--resume"), env=env(), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
