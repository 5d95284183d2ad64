"""Engine fault tolerance with ``sync.transport nccl`` (issue 24, point 3, the part a CPU runs: gloo in
place of NCCL, real embedded servers over HTTP). Two engines share a weight-update group; one is
killed by SIGKILL while it generates: the other keeps serving its half, the killed one is restarted
and re-synced over a weight-update group of its own (the snapshot's buckets broadcast, not read
from disk by the engine), and every request is answered once with the tokens undisturbed engines
give. The next update rebuilds the shared group with the restarted engine in it."""
from __future__ import annotations

import logging
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_helpers import buckets_of, engine_config, perturbed_state  # noqa: E402
from test_engine_faults import _generate_in_thread, _info, _requests, _when_running  # noqa: E402
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory, tokenizer):
    from megaforge.rollout import build_engine

    cfg = engine_config(tmp_path_factory.mktemp("run"), tiny_model_dir, num_engines=2, max_restarts=2,
                        request_timeout_s=30.0, health_timeout_s=10.0, extra_args=["--generate-delay", "1.0"])
    cfg.sync.transport = "nccl"
    eng = build_engine(RunBuilder(cfg).engine_spec(), tokenizer)
    yield eng
    eng.shutdown()
    assert not any(p.alive() for p in eng.processes)


def test_killed_engine_is_resynced_over_its_own_group(engine, tiny_model_dir, caplog):
    _, named = perturbed_state(tiny_model_dir, seed=3)
    engine.update_weights(buckets_of(named, 3), 3)  # one gloo group: this process and both engines
    assert engine.transport == "nccl" and engine.weight_version == 3
    reference = engine.generate(_requests("ref"))
    reqs = _requests("kill")
    served0 = _info(engine, 0)["served_requests"]
    proc = engine.processes[1]
    old_pid = proc.pid
    with caplog.at_level(logging.WARNING, logger="megaforge.sync.transports"):
        t, box = _generate_in_thread(engine, reqs)
        _when_running(engine, 1, lambda: os.kill(old_pid, signal.SIGKILL))
        t.join(300)
    assert "err" not in box, box.get("err")
    out = box["out"]
    assert [c.rid for c in out] == [r.rid for r in reqs]  # every request answered, once, in order
    for c, ref in zip(out, reference):  # seeded: the re-synced engine regenerates the same tokens
        assert c.weight_version == 3 and c.output_ids == ref.output_ids
        assert c.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-6)  # same weights, same kernels
    assert _info(engine, 0)["served_requests"] == served0 + len(reqs) // 2  # engine_0 kept serving its half
    assert proc.pid != old_pid and _info(engine, 1)["weight_version"] == "3"
    assert any("engine_1" in r.message and "re-synced to weight version 3 over weight-update group" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    assert not _info(engine, 1)["weight_update_groups"]  # the re-sync group is gone
    _, named = perturbed_state(tiny_model_dir, seed=4)
    engine.update_weights(buckets_of(named, 2), 4)  # the shared group is rebuilt, with the new engine
    assert engine.weight_version == 4
    assert all(c.weight_version == 4 for c in engine.generate(_requests("after")))
    assert all(len(_info(engine, k)["weight_update_groups"]) == 1 for k in range(2))
