"""The allowlist of a tensor bucket for :mod:`megaforge.sync.unpickle` (what ``/update_weights_from_tensor``
payloads may build), the flattened-bucket metadata record, and torch's legacy storage format.

Builders check before they call torch: argument types; that a tensor view lies inside its storage
(:func:`view_nbytes`); that a shared-memory file is named as torch names them (``/torch_<pid>_<n>_<n>``),
exists under /dev/shm, is at least as large as declared and that its manager is a torch_shm_manager
socket; that tensors carry no Python state or hooks. ``torch.storage._load_from_bytes`` (plain
``pickle`` of CPU tensors) is parsed here (:func:`legacy_storage`) with the same rules: the declared
element count must match the bytes that follow; torch.load is never called.
"""
from __future__ import annotations

import io
import os
import re
import stat
import struct
import types
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
from torch.multiprocessing import reductions as _red

from megaforge.sync.unpickle import (Allowlist, OpcodeRestricted, PayloadError, RestrictedUnpickler, Token,
                                        UnpicklingRefused, as_args, as_bool, as_class, as_int, as_ints, bad,
                                        global_name)

DEFAULT_MAX_BYTES = 16 << 30
CUDA_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_SHM_NAME = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")


@dataclass
class FlattenedTensorMetadata:
    """Same fields as ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


RECORD_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
_TENSOR_CLASSES = {"torch.Tensor": torch.Tensor, "torch.nn.parameter.Parameter": torch.nn.Parameter}
_STORAGE_CLASSES = {"torch.storage.UntypedStorage": torch.UntypedStorage, "torch.UntypedStorage": torch.UntypedStorage,
                    "torch.storage.TypedStorage": torch.storage.TypedStorage}
with warnings.catch_warnings():  # reading .dtype of torch's legacy storage classes warns about TypedStorage
    warnings.simplefilter("ignore", UserWarning)
    _LEGACY_STORAGES = {f"torch.{n}": getattr(torch, n).dtype for n in dir(torch)
                        if n.endswith("Storage") and n not in ("TypedStorage", "UntypedStorage")
                        and isinstance(getattr(getattr(torch, n), "dtype", None), torch.dtype)}
_DTYPES = {f"torch.{n}": d for n, d in vars(torch).items() if isinstance(d, torch.dtype)}


def cuda_device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def rebuild_cuda_tensor_any_device(*args):
    """torch's ``rebuild_cuda_tensor`` with the device given by UUID (as megaforge sends it) or index."""
    dev = args[CUDA_DEVICE_ARG]
    if isinstance(dev, str):
        for i in range(torch.cuda.device_count()):
            if cuda_device_uuid(i) == dev:
                dev = i
                break
        else:
            raise ValueError(f"serialized tensor on CUDA device {dev}, which this engine does not see")
    return _red.rebuild_cuda_tensor(*args[:CUDA_DEVICE_ARG], dev, *args[CUDA_DEVICE_ARG + 1:])


# ------------------------------------------------------------------------------------------ checks
def _dtype(v, what: str) -> torch.dtype:
    if not isinstance(v, torch.dtype):
        bad(what, v, "a torch dtype")
    return v


def view_nbytes(size: tuple, stride: tuple, offset: int, itemsize: int) -> int:
    """Bytes of storage a strided view needs: (offset + sum_d (size_d - 1) stride_d + 1) * itemsize
    (0 for an empty view)."""
    if len(size) != len(stride):
        raise PayloadError(f"tensor view: size {size} and stride {stride} differ in length")
    if any(s == 0 for s in size):
        return 0
    return (offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1) * itemsize


def _check_view(size, stride, offset, itemsize: int, storage_nbytes: int, what: str) -> None:
    need = view_nbytes(as_ints(size, f"{what} size"), as_ints(stride, f"{what} stride"),
                       as_int(offset, f"{what} offset"), itemsize)
    if need > storage_nbytes:
        raise PayloadError(f"{what}: a view of size {tuple(size)}, stride {tuple(stride)} at offset {offset} needs "
                           f"{need} bytes of a storage of {storage_nbytes}")


def _empty_hooks(v, what: str) -> None:
    if type(v) not in (OrderedDict, dict) or v:
        bad(what, v, "an empty OrderedDict (hooks are not transferred)")


# --------------------------------------------------------------------------------------- builders
def _b_rebuild_tensor(u: RestrictedUnpickler, args):
    cls, storage, meta = as_args(args, (3,), "rebuild_tensor")
    cls = as_class(cls, _TENSOR_CLASSES, "rebuild_tensor class")
    if not isinstance(storage, torch.storage.TypedStorage):
        bad("rebuild_tensor storage", storage, "a typed storage")
    offset, size, stride, requires_grad = as_args(meta, (4,), "rebuild_tensor metadata")
    _check_view(size, stride, offset, storage.element_size(), storage.nbytes(), "rebuild_tensor")
    rg = as_bool(requires_grad, "requires_grad")
    return _red.rebuild_tensor(cls, storage, (offset, torch.Size(size), tuple(stride), rg))


def _b_rebuild_typed_storage(u, args):
    storage, dtype = as_args(args, (2,), "rebuild_typed_storage")
    if not isinstance(storage, torch.UntypedStorage):
        bad("rebuild_typed_storage storage", storage, "an untyped storage")
    return _red.rebuild_typed_storage(storage, _dtype(dtype, "rebuild_typed_storage dtype"))


def _shm_manager_ok(manager) -> bool:
    if type(manager) is not bytes or b"\x00" in manager or b".." in manager:
        return False
    parent, base = os.path.split(manager)
    if base != b"manager.sock" or not os.path.basename(parent).startswith(b"torch-shm-dir-"):
        return False
    try:
        return stat.S_ISSOCK(os.stat(manager).st_mode)
    except OSError:
        return False


def _b_rebuild_storage_filename(u: RestrictedUnpickler, args):
    cls, manager, handle, size, *dtype = as_args(args, (4, 5), "rebuild_storage_filename")
    cls = as_class(cls, _STORAGE_CLASSES, "rebuild_storage_filename class")
    if type(handle) is not bytes or not _SHM_NAME.fullmatch(handle):
        bad("shared-memory file name", handle, "a torch shared-memory name (/torch_<pid>_<n>_<n>)")
    if not _shm_manager_ok(manager):
        bad("shared-memory manager", manager, "the socket of a running torch_shm_manager")
    dt = _dtype(dtype[0], "rebuild_storage_filename dtype") if dtype and dtype[0] is not None else None
    nbytes = as_int(size, "shared-memory size") * (dt.itemsize if dt is not None else 1)
    try:
        have = os.stat(b"/dev/shm" + handle).st_size
    except OSError as e:
        raise PayloadError(f"shared-memory file {handle.decode()}: {e.strerror}") from None
    if nbytes > have:
        raise PayloadError(f"shared-memory file {handle.decode()} has {have} bytes, the payload declares {nbytes}")
    u.reserve(nbytes, f"shared-memory file {handle.decode()}")
    return _red.rebuild_storage_filename(cls, manager, handle, size, *([dt] if dtype else []))


def _b_rebuild_storage_empty(u, args):
    (cls,) = as_args(args, (1,), "rebuild_storage_empty")
    return _red.rebuild_storage_empty(as_class(cls, _STORAGE_CLASSES, "rebuild_storage_empty class"))


def _b_rebuild_cuda_tensor(u: RestrictedUnpickler, args):
    a = list(as_args(args, (15,), "rebuild_cuda_tensor"))
    a[0] = as_class(a[0], _TENSOR_CLASSES, "rebuild_cuda_tensor class")
    a[4] = as_class(a[4], _STORAGE_CLASSES, "rebuild_cuda_tensor storage class")
    dtype = _dtype(a[5], "rebuild_cuda_tensor dtype")
    nbytes = as_int(a[8], "CUDA storage size")
    as_int(a[9], "CUDA storage offset")
    _check_view(a[1], a[2], a[3], dtype.itemsize, nbytes, "rebuild_cuda_tensor")
    for i, what in ((7, "CUDA IPC handle"), (11, "ref-counter handle")):
        if type(a[i]) is not bytes:
            bad(what, a[i], "bytes")
    as_bool(a[10], "requires_grad")
    u.reserve(nbytes, "CUDA storage")
    a[1], a[2] = torch.Size(a[1]), tuple(a[2])
    return rebuild_cuda_tensor_any_device(*a)


def _b_rebuild_tensor_v2(u, args):
    storage, offset, size, stride, requires_grad, hooks, *meta = as_args(args, (6, 7), "_rebuild_tensor_v2")
    if not isinstance(storage, torch.storage.TypedStorage):
        bad("_rebuild_tensor_v2 storage", storage, "a typed storage")
    _check_view(size, stride, offset, storage.element_size(), storage.nbytes(), "_rebuild_tensor_v2")
    _empty_hooks(hooks, "backward hooks")
    if meta and meta[0] not in (None, {}):
        bad("tensor metadata", meta[0], "none")
    import torch._utils as tu

    rg = as_bool(requires_grad, "requires_grad")
    return tu._rebuild_tensor_v2(storage, offset, torch.Size(size), tuple(stride), rg, OrderedDict())


def _b_rebuild_parameter(u, args):
    data, requires_grad, hooks = as_args(args, (3,), "_rebuild_parameter")
    if type(data) is not torch.Tensor:
        bad("_rebuild_parameter data", data, "a tensor")
    _empty_hooks(hooks, "backward hooks")
    return torch.nn.Parameter(data, as_bool(requires_grad, "requires_grad"))


def _b_rebuild_from_type_v2(u, args):
    func, new_type, fargs, state = as_args(args, (4,), "_rebuild_from_type_v2")
    if not isinstance(func, Token) or func.name not in ("torch._utils._rebuild_tensor_v2",
                                                        "torch._utils._rebuild_parameter"):
        bad("_rebuild_from_type_v2 function", func, "torch._utils._rebuild_tensor_v2 or _rebuild_parameter")
    ret = BUILDERS[func.name](u, fargs)
    if as_class(new_type, _TENSOR_CLASSES, "_rebuild_from_type_v2 type") is not type(ret) or state not in (None, {}):
        bad("_rebuild_from_type_v2 type/state", (new_type, state), "the rebuilt tensor's own type and no state")
    return ret


def _b_size(u, args):
    (dims,) = as_args(args, (1,), "torch.Size")
    return torch.Size(as_ints(dims, "torch.Size"))


def _b_device(u, args):
    as_args(args, (1, 2), "torch.device")
    if type(args[0]) is not str or (len(args) == 2 and type(args[1]) is not int):
        bad("torch.device", args, "(type string[, index])")
    try:
        return torch.device(*args)
    except (RuntimeError, ValueError) as e:
        raise PayloadError(f"torch.device{args!r}: {e}") from None


def _b_ordered_dict(u, args):
    as_args(args, (0,), "OrderedDict")
    return OrderedDict()


def _b_namespace(u: RestrictedUnpickler, args):
    as_args(args, (0,), "SimpleNamespace")
    return u.new_record(types.SimpleNamespace())


def _b_load_from_bytes(u: RestrictedUnpickler, args):
    (data,) = as_args(args, (1,), "torch.storage._load_from_bytes")
    if type(data) is not bytes:
        bad("torch.storage._load_from_bytes", data, "bytes")
    return legacy_storage(data, u.budget)


BUILDERS = {
    "torch.multiprocessing.reductions.rebuild_tensor": _b_rebuild_tensor,
    "torch.multiprocessing.reductions.rebuild_typed_storage": _b_rebuild_typed_storage,
    "torch.multiprocessing.reductions.rebuild_storage_filename": _b_rebuild_storage_filename,
    "torch.multiprocessing.reductions.rebuild_storage_empty": _b_rebuild_storage_empty,
    "torch.multiprocessing.reductions.rebuild_cuda_tensor": _b_rebuild_cuda_tensor,
    "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified": _b_rebuild_cuda_tensor,
    "torch._utils._rebuild_tensor_v2": _b_rebuild_tensor_v2,
    "torch._utils._rebuild_parameter": _b_rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _b_rebuild_from_type_v2,
    "torch.storage._load_from_bytes": _b_load_from_bytes,
    "torch.Size": _b_size,
    "torch.device": _b_device,
    "collections.OrderedDict": _b_ordered_dict,
    "types.SimpleNamespace": _b_namespace,
}


def _empty_record() -> FlattenedTensorMetadata:
    return object.__new__(FlattenedTensorMetadata)  # fields come from BUILD


TENSOR_BUCKET = Allowlist(
    builders=BUILDERS, tokens=frozenset(_TENSOR_CLASSES) | frozenset(_STORAGE_CLASSES), values=_DTYPES,
    records={"megaforge.sync.tensor_payload.FlattenedTensorMetadata": _empty_record,
             "megaforge.sync.wire.FlattenedTensorMetadata": _empty_record,
             # where the record lived before issue 22 (a payload an older megaforge trainer pickled)
             "megaforge.rollout.tensor_payload.FlattenedTensorMetadata": _empty_record,
             "megaforge.rollout.wire.FlattenedTensorMetadata": _empty_record,
             "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata": _empty_record,
             "types.SimpleNamespace": types.SimpleNamespace},
    record_fields=RECORD_FIELDS)


def load_payload(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES):
    """The object a tensor-bucket pickle carries, built under :data:`TENSOR_BUCKET`."""
    return RestrictedUnpickler(io.BytesIO(raw), TENSOR_BUCKET, max_bytes).load()


# ------------------------------------------------------------------------ torch's legacy storages
class _LegacyRecordUnpickler(OpcodeRestricted):
    """The object pickle of torch's legacy storage format: a persistent id per storage,
    ``('storage', <torch.XStorage>, key, location, numel, view_metadata)``; records them."""

    def __init__(self, file, budget: list):
        super().__init__(file, budget)
        self.records: dict[str, tuple] = {}

    def find_class(self, module, name):
        full = global_name(module, name)
        if full not in _LEGACY_STORAGES:
            raise UnpicklingRefused(full)
        return Token(full)

    def persistent_load(self, pid):
        if type(pid) is not tuple or len(pid) != 6 or pid[0] != "storage":
            bad("legacy storage id", pid, "('storage', type, key, location, numel, None)")
        _, kind, key, location, numel, view = pid
        dtype = as_class(kind, _LEGACY_STORAGES, "legacy storage type")
        if type(key) is not str or location != "cpu" or view is not None:
            bad("legacy storage id", pid, "a key string, location 'cpu' and no view")
        self.records[key] = (dtype, as_int(numel, "legacy storage numel"))
        return Token(f"storage:{key}")


def legacy_storage(data: bytes, budget: Optional[list] = None) -> torch.storage.TypedStorage:
    """The storage of ``torch.save(storage, _use_new_zipfile_serialization=False)`` bytes (what pickling
    a CPU storage writes): magic, protocol, system info, the object pickle with one storage id, the key
    list, then per key an int64 element count and the raw bytes. Counts are checked against the bytes
    present (and ``budget``) before the storage is allocated."""
    budget = budget if budget is not None else [DEFAULT_MAX_BYTES]
    f = io.BytesIO(data)
    header = [OpcodeRestricted(f, budget).load() for _ in range(3)]
    if header[0] != _LEGACY_MAGIC or header[1] != _LEGACY_PROTOCOL or not isinstance(header[2], dict):
        raise PayloadError("torch.storage._load_from_bytes: not torch's legacy storage format (the one pickling "
                           "a storage writes)")
    if header[2].get("little_endian") is not True:
        raise PayloadError("torch.storage._load_from_bytes: only little-endian storages are read")
    objects = _LegacyRecordUnpickler(f, budget)
    top = objects.load()
    keys = OpcodeRestricted(f, budget).load()
    if len(objects.records) != 1 or keys != list(objects.records) or not (isinstance(top, Token)
                                                                          and top.name == f"storage:{keys[0]}"):
        raise PayloadError("torch.storage._load_from_bytes: expected exactly one storage")
    dtype, numel = objects.records[keys[0]]
    raw = f.read(8)
    if len(raw) != 8 or struct.unpack("<q", raw)[0] != numel:
        raise PayloadError(f"torch.storage._load_from_bytes: element count does not match the declared {numel}")
    nbytes = numel * dtype.itemsize
    left = len(data) - f.tell()
    if nbytes != left:
        raise PayloadError(f"torch.storage._load_from_bytes: {numel} {dtype} elements need {nbytes} bytes, "
                           f"{left} follow")
    objects.reserve(nbytes, "inline storage")
    with warnings.catch_warnings():  # a read-only buffer: cloned right away, never written through
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8, offset=f.tell(), count=nbytes).clone() if nbytes else \
            torch.empty(0, dtype=torch.uint8)
    return torch.storage.TypedStorage(wrap_storage=flat.untyped_storage(), dtype=dtype, _internal=True)
