"""What each trainer backend offloads, as tagged :class:`~megaforge.memory.offload.Entry` lists.

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


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


def torch_entries(tr, tags: Sequence[str]) -> list[Entry]:
    """Entries of a :class:`megaforge.trainer.torch_backend.TorchTrainer`."""
    dev, out = tr.device, []
    params = _unique(tr.model.parameters())
    if "weights" in tags:
        out += [Entry(p, "weights") for p in params]
    if "state" in tags:
        out += [Entry(p.grad, "state") for p in params if p.grad is not None]
        out += [Entry(t, "state") for t in _unique(_optimizer_tensors(tr.opt))]
        if getattr(tr, "ref", None) is not None:
            out += [Entry(p, "state") for p in _unique(tr.ref.parameters())]
        critic = getattr(tr, "critic", None)
        if critic is not None:
            cp = _unique(critic.net.parameters())
            out += [Entry(p, "state") for p in cp]
            out += [Entry(p.grad, "state") for p in cp if p.grad is not None]
            out += [Entry(t, "state") for t in _unique(_optimizer_tensors(critic.opt))]
    return [e for e in out if _on(dev, e.tensor)]


def _megatron_optimizers(opt) -> list:
    return [o for o in getattr(opt, "chained_optimizers", [opt]) if getattr(o, "optimizer", None) is not None]


def megatron_entries(tr, tags: Sequence[str]) -> list[Entry]:
    """Entries of a :class:`megaforge.trainer.megatron.trainer.MegatronTrainer`."""
    dev, out = tr.device, []
    models = [(tr.ddp, tr.optimizer)]
    if getattr(tr, "critic", None) is not None:  # the PPO critic: its weights are trainer state, not the policy's
        models.append((tr.critic.ddp, tr.critic.optimizer))
    for k, (ddp, optimizer) in enumerate(models):
        buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []) or [])
        if "weights" in tags and k == 0:
            out += [Entry(b.param_data, "weights", keep=True, movable=False) for b in buffers if b.param_data is not None]
        if "state" in tags:
            if k > 0:  # the critic's weights
                out += [Entry(b.param_data, "state", keep=True, movable=False) for b in buffers if b.param_data is not None]
            out += [Entry(b.grad_data, "state", keep=False, movable=False) for b in buffers if b.grad_data is not None]
            in_buffer = {b.param_data.untyped_storage()._cdata for b in buffers if b.param_data is not None}
            for o in _megatron_optimizers(optimizer):
                inner = o.optimizer
                for group in inner.param_groups:
                    out += [Entry(p, "state") for p in group["params"] if p.untyped_storage()._cdata not in in_buffer]
                out += [Entry(t, "state") for t in _optimizer_tensors(inner)]
    if "state" in tags:
        if tr.ref is not None and tr.cfg.trainer.ref_device != "cpu":
            out += [Entry(p, "state") for p in tr.ref.parameters()]
    seen, uniq = set(), []
    for e in out:
        if id(e.tensor) not in seen and _on(dev, e.tensor):
            seen.add(id(e.tensor))
            uniq.append(e)
    return uniq


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


def torch_optimizers(tr) -> list:
    critic = getattr(tr, "critic", None)
    return [getattr(tr, "opt", None)] + ([critic.opt] if critic is not None else [])


def megatron_optimizers(tr) -> list:
    opts = [tr.optimizer] + ([tr.critic.optimizer] if getattr(tr, "critic", None) is not None else [])
    return [o.optimizer for opt in opts if opt is not None for o in _megatron_optimizers(opt)]
