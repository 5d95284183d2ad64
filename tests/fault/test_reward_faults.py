"""A reward that hangs or always fails, in whole runs: the step's reward phase is bounded by
rewards.timeout_s, the run ends promptly (at its end and on SIGTERM) however many calls are stuck,
and a reward failing on every sample of a step stops the run naming it."""
import json
import os
import signal
import subprocess
import sys
import time

from run_helpers import lines, stop_when

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
HANGS = ["--rewards.functions", "[{name: 'fault_plugins:hang_on_label'}]", "--rewards.timeout_s", "2",
         "--rewards.workers", "2"]


def cmd(out, name, data, *extra):
    return [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), "--config", DEMO, "--sft.max_steps", "0",
            "--rollout.batch_size", "2", "--grpo.n_samples", "2", "--rollout.max_new_tokens", "8",
            "--metrics.progress", "false", "--metrics.tensorboard", "false", "--data.path", str(data),
            "--data.format", "jsonl", "--data.shuffle", "false", "--output_dir", str(out), "--run_name", name, *extra]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.path.dirname(__file__))


def data_file(tmp_path, labels):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": a}) + "\n" for i, a in enumerate(labels)))
    return path


def test_hanging_calls_time_out_per_step_and_the_run_ends(tmp_path):
    """Every batch holds one row whose reward never returns: 2 of its 4 samples time out each
    step, the other samples are scored, and the run exits as soon as it is done."""
    data = data_file(tmp_path, ["hang", "2"] * 4)
    t = time.monotonic()
    p = subprocess.run(cmd(tmp_path, "h", data, "--max_steps", "3", *HANGS), env=env(), capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = lines(os.path.join(tmp_path, "h", "metrics.jsonl"))
    assert [r["reward/timeouts"] for r in recs] == [2.0, 2.0, 2.0] and all(r["reward/errors"] == 0 for r in recs)
    assert all(r["time/reward"] < 2.0 + 3.0 for r in recs)  # about rewards.timeout_s, not n x timeout_s
    assert "no result within rewards.timeout_s=2 s" in p.stdout + p.stderr
    assert time.monotonic() - t < 300


def test_sigterm_with_calls_stuck_stops_promptly(tmp_path):
    data = data_file(tmp_path, ["hang", "2"] * 4)
    run = os.path.join(tmp_path, "s")
    proc = subprocess.Popen(cmd(tmp_path, "s", data, "--max_steps", "100", *HANGS), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t = time.monotonic()
    rc = stop_when(proc, os.path.join(run, "metrics.jsonl"), 1, signal.SIGTERM)
    assert rc == 143, proc.stderr.read()[-3000:]
    assert time.monotonic() - t < 60  # one step (its reward phase <= 2 s) and a checkpoint, not the stuck calls
    assert "received: stopped after RL step" in proc.stderr.read()


def test_reward_failing_on_every_sample_stops_the_run_naming_it(tmp_path):
    data = data_file(tmp_path, ["2"] * 8)
    p = subprocess.run(cmd(tmp_path, "f", data, "--max_steps", "3", "--rewards.functions",
                           "[{name: 'fault_plugins:always_raises'}]"), env=env(), capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 1
    assert ("reward 'always_raises' failed on every sample of step 1 (4 calls: 0 not done within "
            "rewards.timeout_s=30 s, 4 raised or returned a non-number); last: reward 'fault_plugins:always_raises' "
            "failed on sample 3: ConnectionError: reward service unreachable") in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not lines(os.path.join(tmp_path, "f", "metrics.jsonl"))
