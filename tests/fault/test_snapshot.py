"""The weight snapshot that re-syncs a restarted engine: its files hold exactly the bytes the update
sent (safetensors, read back bit for bit), versions replace each other only when complete, and with
sync.transport disk the update's own shards are the snapshot a restarted engine loads."""
from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from engine_helpers import TOKENIZER, buckets_of, perturbed_state  # noqa: E402
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(300)


def test_flat_bucket_written_as_safetensors_bit_exact(tmp_path):
    from safetensors.torch import load_file

    from megaforge.sync import wire
    from megaforge.rollout.http.snapshot import WeightSnapshot

    g = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(5, 3, generator=g)), ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c.idx", torch.arange(6, dtype=torch.int64).reshape(2, 3)), ("d.half", torch.randn(3, generator=g).half())]
    snap = WeightSnapshot(str(tmp_path / "snap"), model_dir="")
    snap.begin(7)
    for bucket in (named[:2], named[2:]):
        flat, metas = wire.flatten(bucket)
        snap.add_flat(flat, metas)
    assert snap.path is None  # nothing complete yet
    path = snap.commit()
    assert path == str(tmp_path / "snap" / "v7") and snap.version == 7
    got = {}
    for f in json.load(open(os.path.join(path, "snapshot.json")))["files"]:
        got.update(load_file(os.path.join(path, f)))
    assert sorted(got) == sorted(n for n, _ in named)
    for n, t in named:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    snap.begin(8)  # an update that fails midway leaves the previous version in place
    flat, metas = wire.flatten(named[:1])
    snap.add_flat(flat, metas)
    snap.abort()
    assert snap.path == path and os.listdir(tmp_path / "snap") == ["v7"]
    snap.begin(8)
    snap.add_flat(*wire.flatten(named))
    snap.commit(wait=False)
    snap.wait()
    assert os.listdir(tmp_path / "snap") == ["v8"] and snap.version == 8  # the old version is gone
    snap.close()
    assert not os.path.exists(tmp_path / "snap" / "v8")


def test_disk_transport_restart_loads_the_update_shards(tiny_model_dir, tmp_path, tokenizer):
    from megaforge.config import config_from_dict
    from megaforge.rollout import build_engine
    from megaforge.types import GenerateRequest, SamplingParams

    cfg = config_from_dict({"output_dir": str(tmp_path), "run_name": "d", "max_steps": 0, "sync": {"transport": "disk"},
                            "model": {"path": tiny_model_dir, "tokenizer": TOKENIZER, "dtype": "float32"},
                            "rollout": {"engine": "embedded_server", "device": "cpu", "startup_timeout_s": 180.0}})
    eng = build_engine(RunBuilder(cfg).engine_spec(), tokenizer)
    try:
        _, named = perturbed_state(tiny_model_dir, seed=5)
        eng.update_weights(buckets_of(named, 2), 5)
        snap = eng.snapshot.path
        assert os.path.basename(snap) == "v5" and len([f for f in os.listdir(snap) if f.endswith(".safetensors")]) == 2
        assert os.path.exists(os.path.join(snap, "config.json"))
        reqs = [GenerateRequest([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=[], seed=3),
                                rid="x")]
        before = eng.generate(reqs)[0]
        os.kill(eng.processes[0].pid, signal.SIGKILL)
        eng.processes[0].proc.wait(10)
        after = eng.generate(reqs)[0]
        assert after.output_ids == before.output_ids and after.weight_version == 5 == eng.weight_version
        assert eng.health_metrics() == {"health/engine_restarts": 1.0}
    finally:
        eng.shutdown()
