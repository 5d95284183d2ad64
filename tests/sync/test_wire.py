"""The /update_weights_from_tensor wire format: flattened buckets through shared memory, the layout
sglang reads, and the restricted unpickler."""
from __future__ import annotations

import base64
import dataclasses
import io
import os
import pickle
import subprocess
import sys
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from engine_helpers import ROOT  # noqa: E402
from megaforge.sync import wire  # noqa: E402

MIXED = [("a.f32", torch.randn(3, 5)), ("b.i16", torch.arange(7, dtype=torch.int16)),
         ("c.bf16", torch.randn(33, 9).to(torch.bfloat16)), ("d.f64", torch.randn(2, dtype=torch.float64)),
         ("e.u8", torch.arange(5, dtype=torch.uint8))]


def test_flattened_bucket_roundtrip_mixed_dtypes_aligned():
    flat, metas = wire.flatten(MIXED)
    assert [m.name for m in metas] == ["d.f64", "a.f32", "b.i16", "c.bf16", "e.u8"]  # largest elements first
    for m in metas:
        assert m.start_idx % m.dtype.itemsize == 0 and m.end_idx - m.start_idx == m.numel
    out = dict(wire.named_tensors_from_payload(wire.deserialize(wire.flattened_bucket_payload(flat, metas)),
                                               wire.FLATTENED_BUCKET))
    for n, t in MIXED:
        assert out[n].dtype == t.dtype and torch.equal(out[n], t), n


def test_cpu_bucket_crosses_processes_through_shared_memory():
    big = [("w", torch.randn(1024, 1024))]  # 4 MiB
    flat, metas = wire.flatten(big)
    payload = wire.flattened_bucket_payload(flat, metas)
    assert flat.is_shared() and len(payload) < 4096  # the pickle carries a shared-memory name, not the bytes
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from megaforge.sync import wire; "
            "named = wire.named_tensors_from_payload(wire.deserialize(sys.stdin.read()), 'flattened_bucket'); "
            "import hashlib; print(hashlib.sha256(named[0][1].numpy().tobytes()).hexdigest())")
    r = subprocess.run([sys.executable, "-c", code, ROOT], input=payload, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import hashlib

    # the bytes themselves, not a sum of them (a float sum in another process may reorder)
    assert r.stdout.strip() == hashlib.sha256(big[0][1].numpy().tobytes()).hexdigest()


def test_sglang_metadata_class_and_plain_pickles_are_read():
    # a payload pickled by a trainer that imports sglang names sglang's FlattenedTensorMetadata
    mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = mod.__name__
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    mod.FlattenedTensorMetadata = FlattenedTensorMetadata
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync"]
    assert not any(n in sys.modules for n in names + [mod.__name__])
    sys.modules.update({n: types.ModuleType(n) for n in names})
    sys.modules[mod.__name__] = mod
    try:
        flat, metas = wire.flatten(MIXED[:2])
        obj = {"flattened_tensor": flat, "metadata": [FlattenedTensorMetadata(**dataclasses.asdict(m)) for m in metas]}
        payload = wire.serialize(obj)
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)  # torch's default strategy: storages as file descriptors
    finally:
        for n in names + [mod.__name__]:
            del sys.modules[n]
    out = dict(wire.named_tensors_from_payload(wire.deserialize(payload), wire.FLATTENED_BUCKET))
    assert torch.equal(out["a.f32"], MIXED[0][1]) and torch.equal(out["b.i16"], MIXED[1][1])
    with pytest.raises(wire.UnpicklingRefused, match="rebuild_storage_fd.*file_system"):
        wire.deserialize(base64.b64encode(buf.getvalue()).decode())
    # load_format null: [(name, tensor)] pickled by plain pickle (torch's own reducers)
    plain = base64.b64encode(pickle.dumps([("x", torch.ones(3)), ("y", torch.zeros(2, 2))])).decode()
    got = wire.named_tensors_from_payload(wire.deserialize(plain), None)
    assert [n for n, _ in got] == ["x", "y"] and torch.equal(got[0][1], torch.ones(3))


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize("fn,args,name", [
    (eval, ("1+1",), "builtins.eval"), (getattr, ("x", "upper"), "builtins.getattr"),
    (subprocess.call, (["true"],), "subprocess.call"), (torch.load, ("/dev/null",), "torch.serialization.load"),
])
def test_unknown_globals_refused_by_name(fn, args, name):
    for proto in (2, pickle.DEFAULT_PROTOCOL):
        payload = base64.b64encode(pickle.dumps({"flattened_tensor": _Reduce(fn, args), "metadata": []}, protocol=proto))
        with pytest.raises(wire.UnpicklingRefused) as e:
            wire.deserialize(payload.decode())
        assert e.value.global_name == name and name in str(e.value)


def test_malformed_payloads_are_named():
    with pytest.raises(ValueError, match="not valid base64"):
        wire.deserialize("%%%")
    with pytest.raises(ValueError, match="flattened_bucket payload must be"):
        wire.named_tensors_from_payload({"tensor": torch.ones(1)}, wire.FLATTENED_BUCKET)
    with pytest.raises(ValueError, match="load_format 'direct'"):
        wire.named_tensors_from_payload([], "direct")
