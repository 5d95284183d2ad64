"""A reward that hangs or always fails, in whole runs: the step's reward phase is bounded by
rewards.timeout_s, the run ends promptly (at its end and on SIGTERM) however many calls are stuck,
and a reward failing on every sample of a step stops the run naming it."""
import json
import os
import signal
import subprocess
import sys
import time

from run_helpers import completed_in_process, lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
HANGS = ["--rewards.functions", "[{name: 'fault_plugins:hang_on_label'}]", "--rewards.timeout_s", "2",
         "--rewards.workers", "2"]


def cmd(out, name, data, *extra):
    return [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), *argv(out, name, data, *extra)]


def argv(out, name, data, *extra):
    return ["--config", DEMO, "--sft.max_steps", "0",
            "--rollout.batch_size", "2", "--grpo.n_samples", "2", "--rollout.max_new_tokens", "8",
            "--metrics.progress", "false", "--metrics.tensorboard", "false", "--data.path", str(data),
            "--data.format", "jsonl", "--data.shuffle", "false", "--output_dir", str(out), "--run_name", name, *extra]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.path.dirname(__file__))


def data_file(tmp_path, labels):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": a}) + "\n" for i, a in enumerate(labels)))
    return path


def test_hanging_calls_time_out_per_step_and_sigterm_still_stops_promptly(tmp_path):
    """Every batch holds one row whose reward never returns: 2 of its 4 samples time out in each
    step (the stuck calls of one step do not hold up the next: the thread pool let them pile up
    until every sample timed out), the reward phase stays about rewards.timeout_s, and SIGTERM
    stops the run after its step and checkpoint instead of waiting on the stuck calls. (A
    process whose calls are stuck ending at once: tests/test_rewards.py.)"""
    data = data_file(tmp_path, ["hang", "2"] * 4)
    run = os.path.join(tmp_path, "h")
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(cmd(tmp_path, "h", data, "--max_steps", "100", *HANGS), env=env(), stdout=out,
                                stderr=err)
        deadline = time.monotonic() + 300
        while len(lines(os.path.join(run, "metrics.jsonl"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.05)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:  # still waiting on its stuck calls
                proc.kill()
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert rc == 143, err[-3000:]
    assert time.monotonic() - t < 60  # one step (its reward phase <= 2 s) and a checkpoint
    assert "received: stopped after RL step" in err
    recs = lines(os.path.join(run, "metrics.jsonl"))
    assert all(r["reward/timeouts"] == 2.0 and r["reward/errors"] == 0 for r in recs), recs
    assert all(r["time/reward"] < 2.0 + 3.0 for r in recs)  # about rewards.timeout_s, not n x timeout_s
    assert "no result within rewards.timeout_s=2 s" in out + err


def test_reward_failing_on_every_sample_stops_the_run_naming_it(tmp_path):
    data = data_file(tmp_path, ["2"] * 8)
    p = completed_in_process("grpo", argv(tmp_path, "f", data, "--max_steps", "3", "--rewards.functions",
                                          "[{name: 'fault_plugins:always_raises'}]"))  # in this process
    assert p.returncode == 1
    assert ("reward 'always_raises' failed on every sample of step 1 (4 calls: 0 not done within "
            "rewards.timeout_s=30 s, 4 raised or returned a non-number); last: reward 'fault_plugins:always_raises' "
            "failed on sample 3: ConnectionError: reward service unreachable") in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not lines(os.path.join(tmp_path, "f", "metrics.jsonl"))
