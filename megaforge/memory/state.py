"""What a trainer offloads, as tagged :class:`~megaforge.memory.offload.Entry` lists.

Each backend lists its own tensors (``Trainer.offload_entries``) with the functions here, which take
modules and optimizers, never a trainer.

Tags: ``weights`` = the policy parameters :meth:`iter_hf_buckets` reads (kept on the device until
the weight sync is done); ``state`` = everything else: gradients, optimizer state (fp32 main
parameters, Adam moments), the frozen reference model, the critic. Only tensors on the trainer's
device are listed (a reference kept on the CPU, torch Adam's CPU ``step`` counters stay put).

torch backend (HF modules): parameters (tied ones once), their ``.grad`` when set, AdamW state;
reference model; critic (network, gradients, AdamW state). Every storage is owned by one tensor, so
all are movable (coalesced into chunks).

megatron backend: DDP's contiguous buffers (``ddp.buffers`` + expert buffers): ``param_data``
(weights, kept) and ``grad_data`` (state, not kept: zero between steps) are fixed (the parameters
and ``main_grad`` are views of them); the optimizer's parameters that live outside those buffers
(fp32 main copies of bf16 parameters, distributed or not) and its state tensors; the reference
model's parameters (``trainer.ref_device`` not ``cpu``); the critic's DDP buffers (weights and
gradients, both ``state``) and optimizer tensors the same way.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from megaforge.memory.offload import ALIGN, Entry, align_up


def _on(dev: torch.device, t) -> bool:
    return torch.is_tensor(t) and t.device.type == dev.type and (dev.index is None or t.device.index == dev.index)


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def on_device(entries: Iterable[Entry], dev: torch.device) -> list[Entry]:
    """``entries`` whose tensor is on ``dev``, each tensor once (the first entry naming it)."""
    seen, out = set(), []
    for e in entries:
        if id(e.tensor) not in seen and _on(dev, e.tensor):
            seen.add(id(e.tensor))
            out.append(e)
    return out


def param_entries(module: torch.nn.Module, tag: str) -> list[Entry]:
    """The parameters of ``module`` (tied ones once), movable, kept."""
    return [Entry(p, tag) for p in _unique(module.parameters())]


def grad_entries(module: torch.nn.Module) -> list[Entry]:
    """The ``.grad`` of ``module``'s parameters where set (``state``)."""
    return [Entry(p.grad, "state") for p in _unique(module.parameters()) if p.grad is not None]


def optimizer_entries(opt) -> list[Entry]:
    """The state tensors of torch optimizer ``opt`` (``state``)."""
    return [Entry(t, "state") for t in _unique(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))]


def megatron_parts(opt) -> list:
    """The members of megatron optimizer ``opt`` (a ChainedOptimizer's, else ``opt`` itself) that hold
    a torch optimizer (``.optimizer``)."""
    return [o for o in getattr(opt, "chained_optimizers", [opt]) if getattr(o, "optimizer", None) is not None]


def ddp_entries(ddp, optimizer, tags: Sequence[str], weights_tag: str = "weights") -> list[Entry]:
    """Entries of a megatron DDP model and its megatron optimizer: the buffers' ``param_data`` under
    ``weights_tag`` (kept, fixed: the parameters are views of it), and for ``state`` the buffers'
    ``grad_data`` (fixed, not kept: zero between steps), the optimizer's parameters outside those
    buffers (fp32 main copies) and its state tensors."""
    buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []) or [])
    out = []
    if weights_tag in tags:
        out += [Entry(b.param_data, weights_tag, keep=True, movable=False) for b in buffers if b.param_data is not None]
    if "state" in tags:
        out += [Entry(b.grad_data, "state", keep=False, movable=False) for b in buffers if b.grad_data is not None]
        in_buffer = {b.param_data.untyped_storage()._cdata for b in buffers if b.param_data is not None}
        for o in megatron_parts(optimizer):
            for group in o.optimizer.param_groups:
                out += [Entry(p, "state") for p in group["params"] if p.untyped_storage()._cdata not in in_buffer]
            out += optimizer_entries(o.optimizer)
    return out


def _lazy_adam_bytes(optimizers) -> int:
    """Bytes of the Adam moments (``exp_avg``, ``exp_avg_sq``: each like its parameter) that torch's
    Adam/AdamW create at their first step, for parameters that have no state yet."""
    total = 0
    for o in optimizers:
        if o is None or "adam" not in type(o).__name__.lower():
            continue
        for group in o.param_groups:
            for p in group["params"]:
                if not o.state.get(p) and _on(p.device, p):
                    total += 2 * (align_up(p.numel() * p.element_size()) + ALIGN)
    return total


def host_reservation(entries_fn, optimizers=()) -> dict[str, int]:
    """{tag: host bytes} the offloader's regions need: the kept storages of the current entries (each
    rounded to the offloader's alignment, plus one alignment of slack) and, for ``state``, the Adam
    moments the optimizers have not created yet (an over-estimate by at most ALIGN bytes a tensor)."""
    out = {}
    for tag in ("weights", "state"):
        seen, n = set(), 0
        for e in entries_fn([tag]):
            st = e.tensor.untyped_storage()
            if e.keep and st._cdata not in seen:
                seen.add(st._cdata)
                n += align_up(st.nbytes()) + ALIGN
        out[tag] = n + (_lazy_adam_bytes(optimizers) if tag == "state" else 0)
    return out
