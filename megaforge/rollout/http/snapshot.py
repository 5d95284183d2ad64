"""The engines' current weights on disk, so that a restarted engine can be re-synced exactly.

Why a snapshot (and not a re-sync from the trainer): a restart happens inside ``generate`` or a
memory/weight call on the rank that feeds the engines, while the other trainer ranks wait elsewhere;
streaming the trainer's buckets is a collective, and in off-policy mode the trainer's weights have
moved on by then. The snapshot is the exact bytes the engines were sent for the version they serve.

Cost, by ``sync.transport``: ``disk`` writes the update's safetensors shards anyway: they *are* the
snapshot (no extra cost). ``shm`` / ``auto`` on CPU tensors: each bucket's flat shared-memory buffer
is written once as a safetensors file (:func:`write_flat`: a header and the buffer, no copy), while
the engines load the same bucket. ``ipc`` / ``nccl`` (CUDA tensors): one device-to-host copy per
bucket, then the same write. Put ``rollout.snapshot_dir`` on a RAM disk (``/dev/shm``) to make it a
memory copy. ``rollout.max_restarts: 0`` turns fault tolerance off and writes no snapshot.

Layout: ``<root>/v<version>/model-KKKKK.safetensors`` (one per bucket) plus the model's
``config.json`` / ``generation_config.json`` (SGLang's ``/update_weights_from_disk`` reads a model
folder) and ``snapshot.json`` ({version, files}). A version is written to ``v<version>.partial-*``
and renamed when complete; the previous version is deleted only then.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from megaforge.sync.wire import FlattenedTensorMetadata

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def write_flat(path: str, flat: torch.Tensor, metas) -> None:
    """Write a flattened bucket (:func:`megaforge.sync.wire.flatten`) as a safetensors file: the
    header lists each tensor's byte range in ``flat``, then ``flat``'s bytes follow unchanged."""
    header, end = {}, 0
    for m in sorted(metas, key=lambda m: m.start_idx):
        if m.start_idx != end:
            raise ValueError(f"snapshot: bucket bytes of {m.name!r} start at {m.start_idx}, expected {end}")
        if m.dtype not in _ST_DTYPES:
            raise ValueError(f"snapshot: dtype {m.dtype} of {m.name!r} has no safetensors code")
        header[m.name] = {"dtype": _ST_DTYPES[m.dtype], "shape": list(m.shape), "data_offsets": [m.start_idx, m.end_idx]}
        end = m.end_idx
    if end != flat.numel():
        raise ValueError(f"snapshot: metadata covers {end} bytes of a {flat.numel()}-byte bucket")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    data = flat.detach().cpu().contiguous().numpy()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(memoryview(data))


def _write_after(event, path: str, flat: torch.Tensor, metas) -> None:
    event.synchronize()
    write_flat(path, flat, metas)


def read_flat(path: str):
    """(flat uint8 tensor, metadata) of a file :func:`write_flat` wrote: the bucket's bytes as they were
    sent, and each tensor's name, dtype, shape and byte range (in buffer order)."""
    codes = {v: k for k, v in _ST_DTYPES.items()}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    metas = []
    for name, h in sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]):
        s, e = h["data_offsets"]
        metas.append(FlattenedTensorMetadata(name, torch.Size(h["shape"]), codes[h["dtype"]], s, e, e - s))
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8), metas


class WeightSnapshot:
    """Versions of the served weights under ``root`` (a fresh temporary folder when empty).

    ``background``: flat buckets (:meth:`add_flat`) and the commit of a tensor update are written by
    one writer thread, so the update does not wait for the disk; a bucket's buffer is kept (CUDA
    buffers are first copied to host memory: the sender reuses them) until written. :meth:`wait`
    returns when everything is written (and raises a write error); a restart waits for it before
    reading :attr:`path`, and the next :meth:`begin` too."""

    def __init__(self, root: str = "", model_dir: str = "", background: bool = True):
        self.owned = not root
        self.root = tempfile.mkdtemp(prefix="megaforge-engine-weights-") if self.owned else os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.model_dir = model_dir
        self.path: Optional[str] = None  # the complete snapshot, None before the first update
        self.version: Optional[int] = None
        self._staging: Optional[str] = None
        self._version = 0
        self._files: list[str] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megaforge-snapshot") if background else None
        self._pending: list = []
        self._host: dict[int, torch.Tensor] = {}  # bucket position -> pinned host copy (CUDA buckets)

    def _run(self, fn, *args) -> None:
        if self._pool is None:
            fn(*args)
        else:
            self._pending.append(self._pool.submit(fn, *args))

    def wait(self) -> None:
        """Until every write so far is done; the first write error is raised."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    # ------------------------------------------------------------------------------------ writing
    def begin(self, version: int) -> str:
        self.abort()
        self._staging = os.path.join(self.root, f"v{int(version)}.partial-{uuid.uuid4().hex[:8]}")
        os.makedirs(self._staging)
        self._files, self._version = [], int(version)
        return self._staging

    def next_file(self) -> str:
        """Path of the next bucket's file in the version being written."""
        name = f"model-{len(self._files):05d}.safetensors"
        self._files.append(name)
        return os.path.join(self._staging, name)

    def add_flat(self, flat: torch.Tensor, metas) -> None:
        """Queue bucket ``flat`` for writing. A CUDA bucket is first copied, asynchronously on the
        current stream (so before the sender can rewrite its buffer), into a pinned host buffer kept
        per bucket position and reused by the next versions; the writer waits for that copy."""
        path = self.next_file()
        if flat.device.type == "cpu":
            self._run(write_flat, path, flat, list(metas))
            return
        k = len(self._files) - 1
        host = self._host.get(k)
        if host is None or host.numel() < flat.numel():
            host = self._host[k] = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        dst = host[:flat.numel()]
        dst.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(flat.device))
        self._run(_write_after, done, path, dst, list(metas))

    def files(self) -> list[str]:
        """The bucket files of the complete snapshot, in the order they were sent."""
        if self.path is None:
            return []
        with open(os.path.join(self.path, "snapshot.json")) as f:
            return [os.path.join(self.path, name) for name in json.load(f)["files"]]

    def buckets(self):
        """The (flat, metadata) buckets of the complete snapshot (:func:`read_flat`), in the order they
        were sent, each read when it is reached."""
        for path in self.files():
            yield read_flat(path)

    def add_named(self, named) -> None:
        """Written now (the disk transport's engines read the files right after)."""
        from safetensors.torch import save_file

        self.wait()
        save_file({n: t.detach().contiguous().cpu() for n, t in named}, self.next_file())

    def commit(self, wait: bool = True) -> Optional[str]:
        """Complete the version being written (the previous one is then deleted); with ``wait``, the
        path of the complete snapshot, else the commit is queued behind the bucket writes."""
        if self._staging is None:
            raise RuntimeError("snapshot: commit() without begin()")
        staging, files, version, self._staging = self._staging, list(self._files), self._version, None
        self._run(self._commit, staging, files, version)
        if wait:
            self.wait()
            return self.path
        return None

    def _commit(self, staging: str, files: list[str], version: int) -> None:
        for f in ("config.json", "generation_config.json"):
            src = os.path.join(self.model_dir, f) if self.model_dir else ""
            if src and os.path.exists(src):
                shutil.copy(src, staging)
        with open(os.path.join(staging, "snapshot.json"), "w") as f:
            json.dump({"version": version, "files": files}, f)
        final = os.path.join(self.root, f"v{version}")
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(staging, final)
        old, self.path, self.version = self.path, final, version
        if old and old != final:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Drop a version that was not completed (the previous complete one stays); waits for writes."""
        try:
            self.wait()
        finally:
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None

    def close(self) -> None:
        try:
            self.abort()
        except Exception:  # noqa: BLE001  (closing: a failed write no longer matters)
            pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.owned:
            shutil.rmtree(self.root, ignore_errors=True)
        elif self.path:
            shutil.rmtree(self.path, ignore_errors=True)
        self.path = self.version = None
