"""Tensors on the wire of SGLang's ``/update_weights_from_tensor``, both ways.

Format (what ``sglang.srt.managers.tp_worker.deserialize_own_rank`` and
``WeightUpdater._update_weights_from_flattened_bucket`` of sglang 0.5.23 read):

* ``serialized_named_tensors`` is a list with one string per engine TP rank; each string is the
  base64 of a pickle written by ``multiprocessing.reduction.ForkingPickler`` (SGLang's
  ``MultiprocessingSerializer``).
* ``load_format: "flattened_bucket"``: the pickled object is
  ``{"flattened_tensor": uint8 [N], "metadata": [m, ...]}`` where each ``m`` has the attributes
  ``name, shape (torch.Size), dtype (torch.dtype), start_idx, end_idx, numel`` (byte offsets into
  the flat buffer); tensor ``i`` is ``flat[start_idx:end_idx].view(dtype).reshape(shape)``.
  We pickle ``m`` as a ``types.SimpleNamespace`` (allowed by SGLang's ``SafeUnpickler``, so the
  trainer needs no sglang import); SGLang's own ``FlattenedTensorMetadata`` is read too.
  Tensors are packed by element size, largest first, so every start is aligned for its dtype (the
  layout ``FlattenedTensorBucket.empty`` computes for ``/update_weights_from_distributed``).
* ``load_format: null``: the pickled object is ``[(name, tensor), ...]``.

CPU tensors travel through shared memory: the flat buffer is allocated in a POSIX shared-memory
file (torch's ``file_system`` strategy) and the pickle carries only its name, so a 512 MB bucket is a
few hundred bytes of JSON and the receiver maps the same pages. CUDA tensors travel as CUDA IPC
handles with the device named by UUID (what SGLang's ``monkey_patch_torch_reductions`` sends).

The receiving side (:func:`deserialize`) uses :class:`megaforge.sync.unpickle.RestrictedUnpickler`
with the allowlist of :mod:`megaforge.sync.tensor_payload`: only containers, torch dtypes/sizes,
metadata records and torch's tensor/storage rebuild functions are built, their arguments and sizes
checked first (any other global is refused with :class:`UnpicklingRefused` naming it);
:func:`checked_layout` then checks every metadata record against the flat buffer before a view is taken.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable, Optional

import torch
from torch.multiprocessing import reductions as _red

from megaforge.sync.tensor_payload import (CUDA_DEVICE_ARG, DEFAULT_MAX_BYTES, FlattenedTensorMetadata,
                                              cuda_device_uuid, load_payload)
from megaforge.sync.unpickle import PayloadError, UnpicklingRefused  # noqa: F401  (raised by deserialize)

FLATTENED_BUCKET = "flattened_bucket"


# ------------------------------------------------------------------------------------ flattening
def packing_order(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Tensors sorted by element size, largest first (stable): every byte offset stays aligned."""
    return sorted(list(named), key=lambda nt: -nt[1].element_size())


def flat_layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[FlattenedTensorMetadata], int]:
    metas, off = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if off % t.element_size():
            raise ValueError(f"flattened bucket: {name!r} ({t.dtype}) would start at unaligned byte {off}")
        metas.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, off, off + n, n))
        off += n
    return metas, off


def _shared_cpu_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor whose storage is a named shared-memory file (no copy when pickled)."""
    storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def flatten(named: Iterable[tuple[str, torch.Tensor]], shared: bool = True,
            to_cpu: bool = False) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """(flat uint8 buffer, metadata) of ``named`` in :func:`packing_order`. The buffer is on the
    tensors' device (CPU when ``to_cpu``); a CPU buffer is allocated in shared memory when ``shared``."""
    named = packing_order(named)
    if not named:
        raise ValueError("flattened bucket: no tensors")
    metas, total = flat_layout(named)
    dev = torch.device("cpu") if to_cpu else named[0][1].device
    if not to_cpu and any(t.device != dev for _, t in named):
        raise ValueError(f"flattened bucket: tensors on several devices ({sorted({str(t.device) for _, t in named})})")
    flat = _shared_cpu_bytes(total) if (shared and dev.type == "cpu") else torch.empty(total, dtype=torch.uint8, device=dev)
    for (name, t), m in zip(named, metas):
        flat[m.start_idx:m.end_idx].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return flat, metas


# ---------------------------------------------------------------------------------- serialising
def _reduce_tensor(t: torch.Tensor):
    fn, args = _red.reduce_tensor(t)
    if t.is_cuda:  # name the device by UUID: the engine may see the GPUs in another order
        args = (*args[:CUDA_DEVICE_ARG], cuda_device_uuid(args[CUDA_DEVICE_ARG]), *args[CUDA_DEVICE_ARG + 1:])
    return fn, args


def _reduce_storage_shared(storage):
    """torch's ``file_system`` sharing strategy, whatever the process-wide strategy is."""
    if storage.is_cuda or storage.device.type != "cpu":
        raise RuntimeError(f"cannot pickle a {storage.device} storage; pickle the tensor instead")
    if storage.size() == 0:
        return (_red.rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()  # no copy when already in a shared-memory file
    storage._shared_incref()
    _red.shared_cache[metadata[1]] = _red.StorageWeakRef(storage)
    return (_red.rebuild_storage_filename, (type(storage),) + metadata)


class _WirePickler(ForkingPickler):
    _extra_reducers = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor,
                       torch.UntypedStorage: _reduce_storage_shared,
                       torch.storage.TypedStorage: _red.reduce_typed_storage}

    def reducer_override(self, obj):
        r = self._extra_reducers.get(type(obj))
        if r is not None:
            return r(obj)
        return NotImplemented


def serialize(obj: Any) -> str:
    """base64 text of ``obj`` pickled as SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``."""
    buf = io.BytesIO()
    _WirePickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flattened_bucket_payload(flat: torch.Tensor, metas: list[FlattenedTensorMetadata]) -> str:
    """One ``serialized_named_tensors`` entry for ``load_format: "flattened_bucket"``."""
    meta_ns = [types.SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype,
                                     start_idx=int(m.start_idx), end_idx=int(m.end_idx), numel=int(m.numel))
               for m in metas]
    return serialize({"flattened_tensor": flat, "metadata": meta_ns})


# -------------------------------------------------------------------------------- deserialising
def deserialize(payload: str | bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Inverse of :func:`serialize` (base64 text or raw pickle bytes), with the restricted unpickler
    (:mod:`megaforge.sync.unpickle`, allowlist :data:`megaforge.sync.tensor_payload.TENSOR_BUCKET`);
    the storages it references may total ``max_bytes``. Refusals raise UnpicklingRefused / PayloadError."""
    if isinstance(payload, str):
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"serialized_named_tensors entry is not valid base64: {e}") from None
    return load_payload(payload, max_bytes)


def _record_field(m, name: str, i: int):
    try:
        return getattr(m, name)
    except AttributeError:
        raise ValueError(f"flattened_bucket metadata[{i}]: no field {name!r}") from None


def checked_layout(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Size, torch.dtype, int, int]]:
    """(name, shape, dtype, start, end) of every metadata record, checked against the flat buffer
    before any view is taken: a unique name; ``end - start`` = prod(shape) * itemsize = ``numel``
    (bytes, as sglang's ``FlattenedTensorBucket``); ``start`` aligned for the dtype; inside the buffer."""
    if not torch.is_tensor(flat) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be a 1-D uint8 tensor, got "
                         f"{getattr(flat, 'dtype', type(flat).__name__)} {tuple(getattr(flat, 'shape', ()))}")
    out, seen = [], set()
    for i, m in enumerate(metadata):
        name, shape, dtype, start, end, numel = (_record_field(m, f, i) for f in
                                                 ("name", "shape", "dtype", "start_idx", "end_idx", "numel"))
        where = f"flattened_bucket metadata[{i}] ({name!r})"
        if type(name) is not str or name in seen:
            raise ValueError(f"{where}: the name must be a string, unique in the bucket")
        seen.add(name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: dtype must be a torch dtype, got {type(dtype).__name__}")
        if not isinstance(shape, (torch.Size, tuple, list)) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape must be non-negative integers, got {shape!r:.80}")
        if not all(type(v) is int for v in (start, end, numel)):
            raise ValueError(f"{where}: start_idx, end_idx and numel must be integers")
        nbytes = math.prod(shape) * dtype.itemsize
        if not (0 <= start <= end <= flat.numel()) or end - start != nbytes or numel != nbytes:
            raise ValueError(f"{where}: bytes [{start}, {end}) (numel {numel}) do not hold shape {tuple(shape)} of "
                             f"{dtype} ({nbytes} bytes) inside a buffer of {flat.numel()}")
        if start % dtype.itemsize:
            raise ValueError(f"{where}: start byte {start} is not aligned for {dtype}")
        out.append((name, torch.Size(shape), dtype, start, end))
    return out


def unflatten(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (any object with the metadata attributes is accepted; see :func:`checked_layout`)."""
    return [(name, flat[start:end].view(dtype).reshape(shape))
            for name, shape, dtype, start, end in checked_layout(flat, metadata)]


def named_tensors_from_payload(obj: Any, load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
    """The ``[(name, tensor)]`` a deserialised payload carries, checked for shape and types."""
    if load_format == FLATTENED_BUCKET:
        if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
            raise ValueError("a flattened_bucket payload must be {'flattened_tensor': ..., 'metadata': [...]}")
        if not torch.is_tensor(obj["flattened_tensor"]) or not isinstance(obj["metadata"], list):
            raise ValueError("flattened_bucket payload: 'flattened_tensor' must be a tensor and 'metadata' a list")
        return unflatten(obj["flattened_tensor"], obj["metadata"])
    if load_format is not None:
        raise ValueError(f"load_format {load_format!r} is not supported; use null or {FLATTENED_BUCKET!r}")
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) and torch.is_tensor(x[1]) for x in obj):
        raise ValueError("a load_format=null payload must be a list of (name, tensor) pairs")
    names = [n for n, _ in obj]
    if len(set(names)) != len(names):
        raise ValueError("a load_format=null payload names a tensor twice")
    return [(n, t) for n, t in obj]
