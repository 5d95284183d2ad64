"""Engine faults in a whole GRPO run (rollout.engine: embedded_server): the engine server killed with
SIGKILL while step 2 generates is restarted and re-synced, the step completes with the same samples,
and every metric of the run equals an undisturbed run's; with rollout.max_restarts 0 the run stops
with an error naming the engine and its log, keeps what it wrote, and --resume finishes it."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from run_helpers import lines
from run_helpers import stable as _stable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
ARGS = ["--config", DEMO, "--sft.max_steps", "0", "--rollout.batch_size", "2", "--grpo.n_samples", "4",
        "--rollout.max_new_tokens", "8", "--max_steps", "3", "--grpo.beta", "0.01", "--deterministic", "true",
        "--metrics.progress", "false", "--metrics.tensorboard", "false", "--checkpoint.interval", "1",
        "--rewards.functions", "[{name: 'fault_plugins:length_reward'}]",
        "--rollout.engine", "embedded_server", "--rollout.device", "cpu",
        # each /generate waits 1.5 s before decoding: the test kills the server inside that window
        "--rollout.extra_args", "['--generate-delay', '1.5']"]
VOLATILE = ("time/", "throughput/", "health/engine_restarts")  # restarts differ by design

pytestmark = pytest.mark.timeout(400)


def cmd(out, name, *extra):
    return [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), *ARGS, "--output_dir", out, "--run_name", name,
            *extra]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.path.dirname(__file__))


def stable(recs):
    return _stable(recs, VOLATILE)


def server_info(run):
    """/server_info of the run's engine_0 (its port from the newest start header of its log)."""
    ports = re.findall(r"megaforge\.rollout\.server .*--port (\d+)", open(os.path.join(run, "logs", "engine_0.log")).read())
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[-1]}/server_info", timeout=10) as r:
        return json.loads(r.read())


def kill_engine_in_step(proc, run, step, timeout=240):
    """SIGKILL the engine server while it generates step ``step``; its pid."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if len(lines(os.path.join(run, "metrics.jsonl"))) >= step - 1:
            try:
                info = server_info(run)
            except OSError:
                info = {}
            if info.get("running_requests", 0) > 0:
                os.kill(info["pid"], signal.SIGKILL)
                return info["pid"]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"never saw step {step} generating: {proc.stderr.read()[-3000:] if proc.stderr else ''}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref"))
    p = subprocess.run(cmd(out, "r"), env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = lines(os.path.join(out, "r", "metrics.jsonl"))
    assert [r["health/engine_restarts"] for r in recs] == [0.0, 0.0, 0.0]
    assert all(r["grad_norm"] > 0 for r in recs)  # every step changes the weights
    return recs


@pytest.mark.slow
def test_kill9_mid_rollout_step_completes_with_identical_metrics(tmp_path, reference):
    out = str(tmp_path)
    run = os.path.join(out, "k")
    p = subprocess.Popen(cmd(out, "k"), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = kill_engine_in_step(p, run, 2)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    recs = lines(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["health/engine_restarts"] for r in recs] == [0.0, 1.0, 0.0]
    # same samples, rewards, logprobs, losses and weight versions as the undisturbed run: the killed
    # step's requests were each answered once, by an engine re-synced to the trainer's weights
    assert stable(recs) == stable(reference)
    log = open(os.path.join(run, "logs", "engine_0.log")).read()
    assert f"engine_0: restart 1 (was pid {killed}" in log
    assert log.count("-m megaforge.rollout.server --model") == 2


@pytest.mark.slow
def test_restart_limit_stops_the_run_naming_engine_and_log_then_resume(tmp_path, reference):
    out = str(tmp_path)
    run = os.path.join(out, "x")
    p = subprocess.Popen(cmd(out, "x", "--rollout.max_restarts", "0"), env=env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    kill_engine_in_step(p, run, 2)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1
    log_path = os.path.join(run, "logs", "engine_0.log")
    assert re.search(r"engine_0 \(http://127\.0\.0\.1:\d+\) failed: EngineUnreachable", err), err[-3000:]
    assert "rollout.max_restarts=0 allows no more" in err and f"Its log: {log_path}" in err
    # the run directory keeps everything written before the failure
    assert [r["step"] for r in lines(os.path.join(run, "metrics.jsonl"))] == [1]
    assert os.listdir(os.path.join(run, "checkpoints")) == ["step_000001"]
    assert os.path.exists(os.path.join(run, "config.yaml")) and os.path.exists(log_path)
    again = subprocess.run(cmd(out, "x", "--rollout.max_restarts", "0", "--resume"), env=env(), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert stable(lines(os.path.join(run, "metrics.jsonl"))) == stable(reference)
