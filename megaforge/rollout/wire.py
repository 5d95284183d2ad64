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

The receiving side (:func:`deserialize`) uses :class:`RestrictedUnpickler`: only containers, torch
dtypes/sizes and torch's tensor/storage rebuild functions are resolvable; any other global is refused
with :class:`UnpicklingRefused` naming it, before anything is called.
"""
from __future__ import annotations

import _compat_pickle
import base64
import binascii
import io
import pickle
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable, Optional

import torch
from torch.multiprocessing import reductions as _red

FLATTENED_BUCKET = "flattened_bucket"


@dataclass
class FlattenedTensorMetadata:
    """Same fields as ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class UnpicklingRefused(ValueError):
    """A pickled payload names a global outside the allowlist; ``.global_name`` is ``module.name``."""

    def __init__(self, global_name: str):
        hint = ""
        if global_name.endswith(".rebuild_storage_fd"):
            hint = (" (CPU tensors must be shared by file name: torch.multiprocessing's 'file_system' strategy, "
                    "as megaforge.rollout.wire.serialize does; file descriptors do not cross unrelated processes)")
        super().__init__(f"refused pickled global {global_name!r}: only torch tensor/storage rebuild "
                         f"functions, dtypes and plain containers may appear in serialized_named_tensors{hint}")
        self.global_name = global_name


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


def unflatten(flat: torch.Tensor, metadata: list) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (any object with the metadata attributes is accepted)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    out = []
    for m in metadata:
        if not (0 <= m.start_idx <= m.end_idx <= flat.numel()):
            raise ValueError(f"metadata of {m.name!r}: bytes [{m.start_idx}, {m.end_idx}) outside a buffer of {flat.numel()}")
        out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


# ---------------------------------------------------------------------------------- serialising
def _cuda_device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


_CUDA_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments


def _reduce_tensor(t: torch.Tensor):
    fn, args = _red.reduce_tensor(t)
    if t.is_cuda:  # name the device by UUID: the engine may see the GPUs in another order
        args = (*args[:_CUDA_DEVICE_ARG], _cuda_device_uuid(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1:])
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
def _rebuild_cuda_tensor_any_device(*args):
    dev = args[_CUDA_DEVICE_ARG]
    if isinstance(dev, str):
        for i in range(torch.cuda.device_count()):
            if _cuda_device_uuid(i) == dev:
                dev = i
                break
        else:
            raise ValueError(f"serialized tensor on CUDA device {dev}, which this engine does not see")
    return _red.rebuild_cuda_tensor(*args[:_CUDA_DEVICE_ARG], dev, *args[_CUDA_DEVICE_ARG + 1:])


def _load_storage_bytes(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise UnpicklingRefused(f"torch.storage._load_from_bytes -> {type(storage).__name__}")
    return storage


_DTYPE_NAMES = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals a tensor payload needs; anything else raises UnpicklingRefused."""

    ALLOWED = {
        ("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str",
                                  "bytes", "bytearray", "slice", "complex")
    } | {
        ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "_reconstructor"),
        ("copyreg", "__newobj_ex__"), ("types", "SimpleNamespace"), ("builtins", "object"),
        ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"), ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"), ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    } | {("torch", n) for n in _DTYPE_NAMES}

    # resolved to local stand-ins, never imported
    MAPPED = {
        ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor_any_device,
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor_any_device,
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    }

    def find_class(self, module, name):
        # Python 2 names (protocol < 3 pickles), mapped as pickle.Unpickler.find_class does
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = (module, name)
        if key in self.MAPPED:
            return self.MAPPED[key]
        if key in self.ALLOWED:
            return super().find_class(module, name)
        raise UnpicklingRefused(f"{module}.{name}")


def deserialize(payload: str | bytes) -> Any:
    """Inverse of :func:`serialize` (base64 text or raw pickle bytes), with the restricted unpickler."""
    if isinstance(payload, str):
        try:
            payload = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"serialized_named_tensors entry is not valid base64: {e}") from None
    return RestrictedUnpickler(io.BytesIO(payload)).load()


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
    return [(n, t) for n, t in obj]

