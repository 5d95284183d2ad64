"""Megatron dist-checkpointing of the trainer (``torch_dist`` format), and offload / onload.

A checkpoint directory holds the policy's sharded state, optionally the optimizer's (fully
reshardable: saved at one TP x PP x DP layout, loadable at another) and the frozen reference
model, plus ``megaforge_trainer.json`` (weight version, LR-schedule position, what was saved).

megatron's writer normally hands results back through a ``multiprocessing`` Manager started with
the *spawn* method, which re-imports the entry script and hangs a script without an
``if __name__ == "__main__":`` guard. Saves here are synchronous, so an in-process queue serves
the same purpose; :func:`save` installs one and no Manager process is started.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue

import torch
import torch.distributed as dist

_STRATEGY = ("torch_dist", 1)
_META = "megaforge_trainer.json"
_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                 "chained_optim_avoid_prefix": True}


def _ensure_adam_state(optimizer) -> None:
    """Materialise torch AdamW's lazily created state (step 0, zero moments: exactly what its first
    ``step`` would create) so megatron can describe it before any step has run."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p.numel() and not inner.state[p]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _sharded(tr, with_optimizer: bool, with_ref: bool, loading: bool) -> dict:
    # a fresh metadata dict each time: megatron caches the current DP group in it (in place)
    md = dict(_OPT_METADATA)
    model_sd = tr.bm.model.sharded_state_dict(metadata=md)
    sd = {"model": model_sd}
    if with_optimizer:
        _ensure_adam_state(tr.optimizer)
        sd["optimizer"] = tr.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=md)
    if with_ref:
        sd["ref"] = tr.ref.sharded_state_dict(prefix="ref.", metadata=md)
    return sd


def save(tr, path: str) -> None:
    """Collective save into directory ``path`` (created; must be empty or absent)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with_opt = bool(tr.cfg.checkpoint.save_optimizer)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    filesystem_async._results_queue = queue.Queue()  # synchronous save: no spawn-method Manager
    dist_checkpointing.save(_sharded(tr, with_opt, tr.ref is not None, loading=False), path,
                            sharded_strategy=_STRATEGY)
    if dist.get_rank() == 0:
        meta = {"version": tr.version, "sched": tr.sched, "optimizer": with_opt, "ref": tr.ref is not None,
                "layout": {k: getattr(tr.cfg.trainer, k) for k in
                           ("tensor_parallel", "pipeline_parallel", "context_parallel")},
                "family": tr.family.name, "layer_spec": tr.spec}
        with open(os.path.join(path, _META + ".tmp"), "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(os.path.join(path, _META + ".tmp"), os.path.join(path, _META))
    dist.barrier()


@contextlib.contextmanager
def _step_tolerant_reshardable_load():
    """megatron-core 0.16.1 bug (torch AdamW, i.e. no TE / apex optimizer): loading the
    ``fully_reshardable`` distributed-optimizer format restores AdamW's per-parameter ``step``
    from the common state first, then copies *every* state key from the loaded shards, which
    deliberately omit ``step``: KeyError. While loading, keys absent from the shards are left as
    restored."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def patched(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            st = self.optimizer.state[main_param]
            if "step" in st:
                tensors = dict(tensors, step=st["step"])
        return orig(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = patched
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = orig


def _unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1 (torch AdamW path) restores one ``step`` tensor object into every
    parameter's state; AdamW increments each parameter's ``step`` in place, so a shared tensor
    advances once per parameter per optimizer step and corrupts the bias correction. Give every
    parameter its own copy."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        for st in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def load(tr, path: str) -> None:
    """Collective load of what :func:`save` wrote, into the current layout (resharding as needed)."""
    from megatron.core import dist_checkpointing

    meta_file = os.path.join(path, _META)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"{meta_file} is missing: not a complete megaforge megatron checkpoint")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta["family"] != tr.family.name:
        raise ValueError(f"{path}: checkpoint of family {meta['family']!r}, trainer is {tr.family.name!r}")
    if meta["ref"] and tr.ref is None:
        tr.snapshot_reference()  # allocate; overwritten below
    sd = _sharded(tr, meta["optimizer"], meta["ref"], loading=True)
    state = dist_checkpointing.load(sd, path, sharded_strategy=_STRATEGY)
    tr.bm.model.load_state_dict(state["model"], strict=True)
    if meta["optimizer"]:
        with _step_tolerant_reshardable_load():
            tr.optimizer.load_state_dict(state["optimizer"])
        _unshare_adam_steps(tr.optimizer)
    if meta["ref"]:
        tr.ref.load_state_dict({k.removeprefix("ref."): v for k, v in state["ref"].items()}, strict=True)
    tr.version = int(meta["version"])
    tr.sched = dict(meta["sched"])


# ---------------------------------------------------------------------------------- offload
def move_state(tr, device) -> None:
    """Move parameters, gradient buffers and optimizer state to ``device`` (``cpu`` to offload).

    Megatron's DDP keeps parameters and gradients in contiguous buffers: their storage is copied
    to (pinned) host memory and freed (``offload_to_cpu``) or reallocated and restored; gradients
    are not kept (they are zero between steps). Optimizer tensors that do not live in those
    buffers (Adam moments, fp32 main copies of bf16 parameters) and the reference model move
    individually.
    """
    to_cpu = torch.device(device).type == "cpu"
    nb = not to_cpu  # host -> device copies may overlap; device -> pageable host copies are synchronous
    buffers = list(tr.ddp.buffers) + list(getattr(tr.ddp, "expert_parallel_buffers", []))
    for b in buffers:
        if to_cpu:
            b.offload_to_cpu(move_params=True, move_grads=True)
        else:
            b.reload_from_cpu(move_params=True, move_grads=True)
    # (after the move: offloaded buffer storages are empty, skipped by the size test below)
    in_buffer = {b.param_data.untyped_storage().data_ptr() for b in buffers if b.param_data is not None}
    for o in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in in_buffer and p.untyped_storage().size() > 0:
                    p.data = p.data.to(device, non_blocking=nb)
        for st in inner.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    st[k] = v.to(device, non_blocking=nb)
    if tr.ref is not None and tr.cfg.trainer.ref_device != "cpu":
        tr.ref.to(device, non_blocking=nb)
    if not to_cpu:
        torch.cuda.synchronize()
