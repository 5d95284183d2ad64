"""Malicious /update_weights_from_tensor payloads (issue 21, item 5): the restricted unpickler builds
only what a tensor bucket needs, checks sizes before allocating, and leaves the process working."""
from __future__ import annotations

import base64
import io
import os
import pickle
import struct
import subprocess
import sys
import tracemalloc

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from engine_helpers import BUILD_ON_CLASS, BYTEARRAY8, BYTEARRAY_CALL, ROOT  # noqa: E402
from megaforge.sync import wire  # noqa: E402
from megaforge.sync.unpickle import PayloadError, UnpicklingRefused  # noqa: E402

REFUSED = (UnpicklingRefused, PayloadError)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_build_on_an_allowed_class_is_refused_and_shm_updates_keep_working():
    """In a fresh process (the old code broke torch there): the attack, then a real shm bucket."""
    code = f"""
import sys, base64, torch
sys.path.insert(0, {ROOT!r})
from megaforge.sync import wire  # noqa: E402
real = torch.UntypedStorage._new_shared_filename_cpu
try:
    wire.deserialize({b64(BUILD_ON_CLASS)!r})
    print("accepted")
except ValueError as e:
    print("refused:", type(e).__name__, e)
print("class untouched:", torch.UntypedStorage._new_shared_filename_cpu is real)
flat, metas = wire.flatten([("w", torch.arange(6.0))])
named = wire.named_tensors_from_payload(wire.deserialize(wire.flattened_bucket_payload(flat, metas)), "flattened_bucket")
print("shm update:", named[0][1].tolist())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "refused:" in out and "class untouched: True" in out, out
    assert "shm update: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in out, out


@pytest.mark.parametrize("raw,what", [(BYTEARRAY_CALL, "builtins.bytearray"), (BYTEARRAY8, "BYTEARRAY8")])
def test_no_large_allocation_from_a_few_bytes(raw, what):
    assert len(raw) <= 40
    tracemalloc.start()
    try:
        with pytest.raises(REFUSED, match=what):
            wire.deserialize(b64(raw))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated while refusing a {len(raw)}-byte payload"


class _Call:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _shared_storage(nbytes: int):
    """A shared-memory storage as a sender pickles it (named file, one reference held for the receiver)."""
    flat, _ = wire.flatten([("w", torch.zeros(nbytes, dtype=torch.uint8))])
    storage = flat.untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()
    return flat, manager, handle, size


def test_shared_memory_sizes_are_checked_against_the_file():
    from torch.multiprocessing.reductions import rebuild_storage_filename

    flat, manager, handle, size = _shared_storage(16)
    big = pickle.dumps(_Call(rebuild_storage_filename, (torch.UntypedStorage, manager, handle, 1 << 40)))
    with pytest.raises(PayloadError, match=r"has \d+ bytes, the payload declares 1099511627776"):
        wire.deserialize(b64(big))
    for bad_handle in (b"/../../etc/passwd", b"/torch_1_2_3_nonexistent", "/torch_1_2_3"):
        evil = pickle.dumps(_Call(rebuild_storage_filename, (torch.UntypedStorage, manager, bad_handle, 16)))
        with pytest.raises(PayloadError, match="shared-memory"):
            wire.deserialize(b64(evil))
    evil = pickle.dumps(_Call(rebuild_storage_filename, (torch.UntypedStorage, b"/run/some.sock", handle, 16)))
    with pytest.raises(PayloadError, match="manager"):
        wire.deserialize(b64(evil))
    ok = pickle.dumps(_Call(rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size)))
    assert wire.deserialize(b64(ok)).nbytes() == 16


def test_payload_byte_limit():
    flat, metas = wire.flatten([("w", torch.zeros(1024, dtype=torch.uint8))])
    payload = wire.flattened_bucket_payload(flat, metas)
    assert wire.deserialize(payload, max_bytes=1024)["flattened_tensor"].numel() == 1024
    with pytest.raises(PayloadError, match="max-bucket-mb"):
        wire.deserialize(payload, max_bytes=1023)


def test_a_flood_of_empty_list_opcodes_is_refused_before_it_is_built():
    """Issue 40: 53 MB of ``]`` (EMPTY_LIST) took a server from 0.7 to 3.3 GB. The opcode bound (2**20)
    refuses such a payload before building more lists than that, while a real bucket of 300 tensors
    stays far inside it."""
    flood = b"\x80\x04" + b"]" * ((1 << 20) + 10) + b"."  # 1 M lists, then a STOP: no other error
    with pytest.raises(PayloadError, match="more than 1048576 pickle opcodes"):
        wire.deserialize(flood)
    many = [(f"layer.{i}.weight", torch.zeros(2, 2)) for i in range(300)]
    assert len(wire.named_tensors_from_payload(wire.deserialize(wire.serialize(many)), None)) == 300


def test_tensor_views_must_lie_inside_their_storage():
    from torch.multiprocessing.reductions import rebuild_storage_filename, rebuild_tensor, rebuild_typed_storage

    def tensor_payload(meta):
        flat, manager, handle, size = _shared_storage(16)  # a new file each time: the receiver maps it once
        untyped = _Call(rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size))
        raw = pickle.dumps(_Call(rebuild_tensor, (torch.Tensor, _Call(rebuild_typed_storage, (untyped, torch.float32)),
                                                  meta)))
        return b64(raw), flat

    payload, keep = tensor_payload((0, (4,), (1,), False))  # 4 float32 = the 16 bytes
    assert wire.deserialize(payload).shape == (4,)
    for meta in ((0, (5,), (1,), False), (2, (3,), (1,), False), (0, (2, 2), (10, 1), False), (0, (4,), (-1,), False),
                 (0, (4,), (1,), "yes")):
        payload, keep = tensor_payload(meta)
        with pytest.raises(PayloadError):
            wire.deserialize(payload)


def test_flattened_metadata_is_checked_before_views():
    flat, metas = wire.flatten([("a", torch.arange(4.0)), ("b", torch.arange(3, dtype=torch.int16))])
    ok = wire.deserialize(wire.flattened_bucket_payload(flat, metas))
    good = [vars(m).copy() for m in ok["metadata"]]

    def payload_with(i, **change):
        rows = [dict(r) for r in good]
        rows[i].update(change)
        import types

        return {"flattened_tensor": ok["flattened_tensor"], "metadata": [types.SimpleNamespace(**r) for r in rows]}

    cases = [(dict(end_idx=1 << 40), "inside a buffer"), (dict(shape=torch.Size([5])), "do not hold shape"),
             (dict(start_idx=2, end_idx=18), "do not hold shape|not aligned"), (dict(name="b"), "unique"),
             (dict(dtype="float32"), "torch dtype"), (dict(shape=(-1,)), "non-negative")]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            wire.named_tensors_from_payload(payload_with(0, **change), wire.FLATTENED_BUCKET)
    # a record with an unknown field, or a BUILD on anything but a fresh record, fails in the unpickler
    raw = (b"\x80\x04" + b"\x8c\x05types\x8c\x0fSimpleNamespace\x93)R" + b"}\x8c\x04evil\x88s" + b"b.")
    with pytest.raises(PayloadError, match="metadata record fields"):
        wire.deserialize(b64(raw))
    raw = b"\x80\x04" + b"\x8c\x05torch\x8c\x04Size\x93" + b"}\x8c\x04name\x88s" + b"b."
    with pytest.raises(PayloadError, match="BUILD"):
        wire.deserialize(b64(raw))


def _legacy_storage_bytes(numel_declared: int, numel_written: int, data: bytes) -> bytes:
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "k", "cpu", numel_declared, None) if obj == "S" else None

    buf = io.BytesIO()
    for x in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}):
        pickle.dump(x, buf, protocol=2)
    P(buf, protocol=2).dump("S")
    pickle.dump(["k"], buf, protocol=2)
    return buf.getvalue() + struct.pack("<q", numel_written) + data


def test_inline_storages_declared_larger_than_their_bytes_are_refused():
    from torch.storage import _load_from_bytes

    good = _legacy_storage_bytes(2, 2, struct.pack("<2f", 1.5, -2.0))
    t = wire.deserialize(b64(pickle.dumps(_Call(_load_from_bytes, (good,)))))
    assert t.dtype == torch.float32 and t.tolist() == [1.5, -2.0]
    for bad, msg in ((_legacy_storage_bytes(1 << 40, 1 << 40, b"\x00" * 8), "need 4398046511104 bytes, 8 follow"),
                     (_legacy_storage_bytes(1 << 40, 2, b"\x00" * 8), "element count"),
                     (b"PK\x03\x04" + b"\x00" * 40, "not allowed|malformed|legacy")):
        with pytest.raises(PayloadError, match=msg):
            wire.deserialize(b64(pickle.dumps(_Call(_load_from_bytes, (bad,)))))
    # plain pickles of tensors (torch's own reducers) still load
    plain = pickle.dumps([("x", torch.arange(3.0)), ("p", torch.nn.Parameter(torch.ones(2)))])
    got = dict(wire.named_tensors_from_payload(wire.deserialize(b64(plain)), None))
    assert got["x"].tolist() == [0.0, 1.0, 2.0] and isinstance(got["p"], torch.nn.Parameter)


def test_tensor_with_python_state_or_hooks_is_refused():
    t = torch.ones(2)
    t.evil = "x"  # pickled through _rebuild_from_type_v2 with a state
    with pytest.raises(PayloadError, match="state"):
        wire.deserialize(b64(pickle.dumps([("t", t)])))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_bucket_after_attacks_in_the_receiving_process():
    """A receiver that refused the malicious payloads still maps a CUDA IPC bucket (the ipc transport)."""
    named = [("a", torch.randn(256, 64, device="cuda")), ("b", torch.arange(10, device="cuda", dtype=torch.int32))]
    flat, metas = wire.flatten(named)
    assert flat.is_cuda
    payload = wire.flattened_bucket_payload(flat, metas)
    code = f"""
import sys, base64, torch
sys.path.insert(0, {ROOT!r})
from megaforge.sync import wire  # noqa: E402
for raw in {[b64(BUILD_ON_CLASS), b64(BYTEARRAY_CALL), b64(BYTEARRAY8)]!r}:
    try:
        wire.deserialize(raw)
        print("accepted")
    except ValueError:
        pass
named = dict(wire.named_tensors_from_payload(wire.deserialize(sys.stdin.read()), "flattened_bucket"))
print(named["a"].is_cuda, repr(float(named["a"].double().sum())), named["b"].tolist())
"""
    r = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    is_cuda, total, ints = r.stdout.split(" ", 2)
    assert "accepted" not in r.stdout and is_cuda == "True"
    assert float(total) == pytest.approx(float(named[0][1].double().sum()), rel=1e-12)
    assert ints.strip() == str(list(range(10)))
