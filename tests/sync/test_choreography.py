"""The colocated step's order (DESIGN.md "One RL step, colocated"; megaforge.loop) in a real GRPO run
with the embedded engine server: recorders around the engine's HTTP clients and the trainer's
offload/onload/iter_hf_buckets (choreo_driver.py) log every transition; the order, the memory tags,
the weight versions the engine answers /generate with, and the per-transition timings are checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(400)
CHOREO = {"/generate", "/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
          "/update_weights_from_tensor", "/end_weight_update", "/pause_generation", "/continue_generation"}


def _events(calls):
    out = []
    for who, what, arg, *rest in calls:
        if who == "trainer":
            out.append(f"{what}({','.join(arg) if isinstance(arg, list) else ('all' if arg is None else 'b')})")
        elif what in CHOREO:
            out.append(what.strip("/") + (f"{arg}" if what != "/update_weights_from_tensor" else ""))
    return out


def test_colocated_order_versions_and_timings(tmp_path):
    out = str(tmp_path)
    args = ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--output_dir", out, "--run_name", "c",
            "--sft.max_steps", "0", "--max_steps", "3", "--rollout.batch_size", "2", "--grpo.n_samples", "2",
            "--rollout.max_new_tokens", "6", "--rollout.engine", "embedded_server", "--rollout.device", "cpu",
            "--rollout.max_restarts", "0", "--sync.transport", "shm", "--memory.offload", "pinned",
            "--metrics.progress", "false", "--metrics.tensorboard", "false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(HERE, "choreo_driver.py"), out, *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=360)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    with open(os.path.join(out, "calls.json")) as f:
        calls = json.load(f)
    ev = _events(calls)
    sync = ["begin_weight_updateNone", "iter_hf_buckets(b)", "update_weights_from_tensor", "end_weight_updateNone",
            "offload(weights)"]  # (the bucket iterator is pulled inside the engine's update session)
    initial = ["offload(state)", "onload(weights)"] + sync  # the engine starts from the trainer's weights
    def step(v):  # /generate answered with version v: the weights pushed after the previous step
        return ([f"generate['{v}']", "release_memory_occupation['weights', 'kv_cache']", "onload(all)", "offload(state)",
                 "offload(state)", "onload(weights)", "resume_memory_occupation['weights']"] + sync
                + ["resume_memory_occupation['kv_cache']"])
    assert ev == initial + step(0) + step(1) + step(2), "\n".join(ev)
    # /generate of step s is answered with the weights of version s - 1 (one optimizer step per RL step)
    gens = [arg for who, what, arg, *_ in calls if what == "/generate"]
    assert gens == [["0"], ["1"], ["2"]]
    # the update carrying the version is the last bucket of each sync, after the trainer's step
    versions = [arg for who, what, arg, *_ in calls if what == "/update_weights_from_tensor" and arg is not None]
    assert versions == ["0", "1", "2", "3"]
    with open(os.path.join(out, "c", "metrics.jsonl")) as f:
        recs = [json.loads(l) for l in f]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k in ("time/release", "time/onload", "time/train", "time/offload", "time/resume", "time/sync"):
            assert k in r and r[k] >= 0.0, k
        assert r["weight_version"] == r["step"]
