"""Apply a family's table: HF tensors -> one Megatron TP shard, Megatron TP shards -> HF tensors.

``get_hf(name) -> Tensor`` abstracts where HF tensors come from (a safetensors directory, an
in-memory state dict); see :class:`HFSource`.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional, Sequence

import torch

from megaforge.convert.families import ParamMap
from megaforge.convert.layouts import Dims, get_layout


def to_megatron_shard(pm: ParamMap, get_hf: Callable[[str], torch.Tensor], dims: Dims, tp: int, rank: int) -> torch.Tensor:
    """The TP-rank ``rank`` shard of Megatron parameter ``pm.megatron``."""
    layout = get_layout(pm.layout)
    try:
        full = layout.to_megatron([get_hf(n) for n in pm.hf], dims)
        return layout.shard(full, tp, rank, dims)
    except ValueError as e:
        raise ValueError(f"{pm.megatron} <- {list(pm.hf)}: {e}") from e


def to_hf(pm: ParamMap, shards: Sequence[torch.Tensor], dims: Dims) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of one Megatron parameter from all its TP shards (rank order)."""
    layout = get_layout(pm.layout)
    try:
        full = layout.merge(list(shards), dims)
        return list(zip(pm.hf, layout.to_hf(full, dims)))
    except ValueError as e:
        raise ValueError(f"{pm.megatron} -> {list(pm.hf)}: {e}") from e


def hf_shapes(pm: ParamMap, shard_shape: Sequence[int], tp: int, dims: Dims) -> list[tuple]:
    layout = get_layout(pm.layout)
    return layout.hf_shapes(layout.full_shape(shard_shape, tp), dims)


class HFSource:
    """HF tensors by name from a model directory (``*.safetensors``, read lazily) or a state dict."""

    def __init__(self, path: Optional[str] = None, state_dict: Optional[dict] = None):
        self.state_dict = state_dict
        self.path = path
        self._index: dict[str, str] = {}
        self._handles = {}
        if state_dict is None:
            if path is None:
                raise ValueError("HFSource needs a model directory or a state dict")
            idx = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(idx):
                with open(idx) as f:
                    self._index = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
            else:
                single = os.path.join(path, "model.safetensors")
                if not os.path.exists(single):
                    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
                from safetensors import safe_open

                with safe_open(single, "pt") as f:
                    self._index = {k: single for k in f.keys()}

    def names(self) -> list[str]:
        return list(self.state_dict if self.state_dict is not None else self._index)

    def missing_files(self) -> dict[str, list[str]]:
        """{shard file named by the index but absent: [tensor names it should hold]}."""
        out: dict[str, list[str]] = {}
        if self.state_dict is None:
            for name, f in self._index.items():
                if not os.path.exists(f):
                    out.setdefault(f, []).append(name)
        return out

    def _handle(self, name: str):
        if name not in self._index:
            raise KeyError(f"HF tensor {name!r} is not in {self.path}")
        file = self._index[name]
        if file not in self._handles:
            if not os.path.exists(file):
                raise FileNotFoundError(f"HF shard {file} (holding {name}) is missing from {self.path}")
            from safetensors import safe_open

            self._handles[file] = safe_open(file, "pt")
        return self._handles[file]

    def meta(self, name: str) -> tuple[tuple, torch.dtype]:
        """(shape, dtype) of an HF tensor without reading its data."""
        if self.state_dict is not None:
            t = self(name)
            return tuple(t.shape), t.dtype
        sl = self._handle(name).get_slice(name)
        dt = sl.get_dtype()
        dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                  "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32}
        return tuple(sl.get_shape()), dtypes.get(dt, dt)

    def __call__(self, name: str) -> torch.Tensor:
        if self.state_dict is not None:
            if name not in self.state_dict:
                raise KeyError(f"HF tensor {name!r} is not in the state dict")
            return self.state_dict[name]
        return self._handle(name).get_tensor(name)
