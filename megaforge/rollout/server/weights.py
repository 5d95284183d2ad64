"""Reading ``/update_weights_from_disk`` checkpoints for the embedded server: where it may read, and
every file and tensor checked before the first weight changes (an update is all or nothing).

Where (:func:`checkpoint_files`): ``model_path`` is a directory, taken literally (glob characters are
not expanded), whose ``*.safetensors`` files are read. With ``--weight-root`` directories configured,
the directory and every file (symbolic links resolved) must lie under one of them; a server bound
beyond loopback without any ``--weight-root`` reads nothing from disk. Refusals raise
:class:`WeightPathRefused` (HTTP 403).

What (:func:`read_checkpoint`): each file's safetensors header is parsed and checked (size, JSON,
known dtypes, offsets inside the file, shapes matching the byte ranges); every tensor name must exist
in the engine's model with the same shape and a compatible dtype (``check_specs``), and appear in one
file only; then every tensor is read into host memory. Any failure raises :class:`CheckpointError`
naming the file (HTTP 400) before the engine is touched; the caller then copies all tensors at once.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import torch

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class WeightPathRefused(PermissionError):
    """``model_path`` (or a file in it) is outside the directories this server may read."""


class CheckpointError(ValueError):
    """A checkpoint file is malformed or does not fit the engine's model; ``.path`` names the file."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, r]) == r for r in roots)


def checkpoint_files(model_path: str, roots: Iterable[str], beyond_loopback: bool) -> list[str]:
    """The ``*.safetensors`` files of directory ``model_path`` that this server may read (sorted)."""
    roots = [os.path.realpath(r) for r in roots]
    if beyond_loopback and not roots:
        raise WeightPathRefused("this server is bound beyond loopback and reads weights from disk only under "
                                "--weight-root directories (config key rollout.weight_roots); none is configured")
    if roots and not _inside(model_path, roots):
        raise WeightPathRefused(f"model_path {model_path!r} is outside the --weight-root directories {roots}")
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path {model_path!r} is not a directory (it is read literally: no glob "
                                f"patterns)")
    files = sorted(os.path.join(model_path, f) for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in model_path {model_path!r}")
    outside = [f for f in files if roots and not _inside(f, roots)]
    if outside:
        raise WeightPathRefused(f"{outside[0]} resolves to {os.path.realpath(outside[0])!r}, outside the "
                                f"--weight-root directories {roots}")
    return files


def safetensors_header(path: str) -> dict[str, tuple[torch.dtype, tuple, int, int]]:
    """name -> (dtype, shape, start, end) of a safetensors file, every entry checked against the file size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(path, "shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(path, f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(path, f"header is not valid JSON ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header is not a JSON object")
    data = size - 8 - n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(e, dict) and e.get("dtype") in _ST_DTYPES and isinstance(e.get("shape"), list) \
            and all(type(d) is int and d >= 0 for d in e["shape"]) and isinstance(e.get("data_offsets"), list) \
            and len(e["data_offsets"]) == 2 and all(type(o) is int for o in e["data_offsets"])
        if not ok:
            raise CheckpointError(path, f"tensor {name!r}: malformed header entry {json.dumps(e)[:200]}")
        dtype, shape, (start, end) = _ST_DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
        need = dtype.itemsize
        for d in shape:
            need *= d
        if not 0 <= start <= end <= data or end - start != need:
            raise CheckpointError(path, f"tensor {name!r}: bytes [{start}, {end}) of {data} do not hold shape "
                                        f"{list(shape)} of {e['dtype']} ({need} bytes)")
        out[name] = (dtype, shape, start, end)
    return out


def read_checkpoint(files: list[str], check_specs: Callable[[list], None]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``files``, after all headers passed :func:`safetensors_header` and
    ``check_specs([(name, shape, dtype)])`` (the engine's check; it raises naming the tensor)."""
    from safetensors.torch import load_file

    seen: dict[str, str] = {}
    for path in files:
        specs = []
        for name, (dtype, shape, _, _) in safetensors_header(path).items():
            if name in seen:
                raise CheckpointError(path, f"tensor {name!r} is also in {seen[name]}")
            seen[name] = path
            specs.append((name, shape, dtype))
        try:
            check_specs(specs)
        except (KeyError, ValueError) as e:
            raise CheckpointError(path, str(e).strip("'\"")) from None
    named = []
    for path in files:
        try:
            named += list(load_file(path).items())
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error type; the file is named)
            raise CheckpointError(path, f"cannot load: {type(e).__name__}: {e}") from None
    return named
