"""Counting, on the CPU, the host reads of device values that would each be a device sync on a GPU.

:class:`DeviceReads` marks as *device values* the given tensors (a model's parameters) and every tensor
an operator computes from a marked one (a dispatch mode sees every operator, backward and optimizer
included; an operator writing into a tensor marks it too). ``TrainBatch.to(device)`` stands for the upload of a
batch: on the CPU it would return the same tensors, here it returns marked copies, so the batch on the
"device" holds device values while the host batch does not. A *read* is what
makes the host wait for a device value: ``item()`` / ``float()`` / ``int()`` / ``bool()``
(``aten._local_scalar_dense``), an operator whose output size depends on the values (``nonzero``,
``masked_select``, ``unique``), or an explicit copy to the host (``.cpu()``, ``.tolist()``,
``.numpy()``) of a marked tensor. ``.to(...)`` is not counted: on the CPU a copy to the host cannot be
told from a move on the device (the trainer's copies to the host are ``.cpu()`` and ``.tolist()``).
"""
from __future__ import annotations

import os
import traceback

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

_SIZE_FROM_VALUES = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
                     "aten::unique_dim", "aten::unique_consecutive")


def _origin() -> str:
    """The top-level package of the innermost frame outside torch and this module."""
    for f in reversed(traceback.extract_stack()[:-2]):
        path = f.filename.replace(os.sep, "/")
        if "/torch/" in path or path.endswith("device_reads.py"):
            continue
        for package in ("megaforge", "transformers", "peft"):
            if f"/{package}/" in path:
                return package
        return os.path.basename(path)
    return "?"


class DeviceReads(TorchDispatchMode):
    """``with DeviceReads(params) as r: ...`` then ``r.count``; ``r.where``: (what was read, the package of
    the innermost caller outside torch: ``megaforge``, ``transformers``, ...) per read."""

    def __init__(self, sources):
        super().__init__()
        self.marked = WeakIdKeyDictionary()
        for t in sources:
            self.marked[t] = True
        self.count = 0
        self.where: list[tuple[str, str]] = []
        self._saved = {}

    def _hot(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.marked

    def _read(self, what: str) -> None:
        self.count += 1
        self.where.append((what, _origin()))

    def count_from(self, package: str) -> int:
        """The reads whose innermost caller outside torch is in ``package``."""
        return sum(origin == package for _, origin in self.where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = pytree.tree_leaves((args, kwargs))
        hot = any(self._hot(t) for t in flat)
        if hot and func._schema.name in _SIZE_FROM_VALUES:
            self._read(func._schema.name)
        out = func(*args, **kwargs)
        if hot:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.marked[t] = True
            for i, arg in enumerate(func._schema.arguments):  # in-place and out= writes
                info = arg.alias_info
                if info is not None and info.is_write:
                    v = args[i] if i < len(args) else kwargs.get(arg.name)
                    for t in pytree.tree_leaves(v):
                        if isinstance(t, torch.Tensor):
                            self.marked[t] = True
        return out

    def __enter__(self):
        from megaforge.types import TrainBatch

        mode = self
        T = torch.Tensor
        self._saved = {(T, name): getattr(T, name) for name in ("cpu", "tolist", "numpy")}
        self._saved[(TrainBatch, "to")] = TrainBatch.to
        orig = self._saved

        def copy_out(name):
            def f(t, *a, **k):
                if mode._hot(t):
                    mode._read(name)
                return orig[(T, name)](t, *a, **k)
            return f

        def upload(t: torch.Tensor) -> torch.Tensor:
            out = t.clone()
            mode.marked[out] = True
            return out

        def batch_to(batch, device):  # the trainer's upload of a batch: device values from here on
            return orig[(TrainBatch, "to")](batch, device).apply(upload)

        T.cpu, T.tolist, T.numpy = copy_out("cpu"), copy_out("tolist"), copy_out("numpy")
        TrainBatch.to = batch_to
        return super().__enter__()

    def __exit__(self, *exc):
        for (cls, name), f in self._saved.items():
            setattr(cls, name, f)
        return super().__exit__(*exc)
