"""Megatron DDP wrapping and the Adam(W) optimizer step as the megatron trainer and critic use them."""
from __future__ import annotations

import math

import torch

from megaforge.memory.state import megatron_parts


def wrap_ddp(tconfig, module, distributed_optimizer: bool):
    """megatron's DistributedDataParallel as the trainer uses it: gradients reduced in fp32, no
    overlap with backward (the step's schedule is exact, see the module doc)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(config=tconfig, module=module, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer))


def finalize_grads(models, num_tokens=None, *args, **kwargs):
    """megatron's finalize_model_grads without the token-count rescaling: the losses are already
    contributions to the mini-batch's objective (see megaforge.trainer.megatron.trainer)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(models, None)


def adam_optimizer(t, ddp, dtype: torch.dtype, lr: float, min_lr: float = 0.0):
    """A fresh megatron Adam(W) over ``ddp`` with ``trainer`` config ``t``'s betas, eps, weight decay
    and clip (distributed when configured). No config overrides: weight decay applies to every
    parameter (megatron's standard overrides would skip biases and norms)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    oc = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=t.weight_decay, adam_beta1=t.betas[0],
        adam_beta2=t.betas[1], adam_eps=t.eps, clip_grad=t.grad_clip, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, params_dtype=dtype, use_distributed_optimizer=t.distributed_optimizer,
    )
    return get_megatron_optimizer(oc, [ddp], config_overrides={})


def set_lr_and_decay(opt, lr: float, weight_decay: float) -> None:
    """Set every parameter group's learning rate and weight decay (times the group's multipliers)."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
        g["weight_decay"] = weight_decay * g.get("wd_mult", 1.0)


def clipped_step(opt, clip: float) -> tuple[float, bool]:
    """One step of megatron optimizer ``opt`` on ready gradients, clipped to global norm ``clip``
    (0: no clipping). A non-finite norm (or fp16 overflow) zeroes the gradients and skips the step.
    Returns (grad norm, whether the step was taken)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = opt.prepare_grads()
    norm = float(opt.get_grad_norm())
    if found_inf or not math.isfinite(norm):
        opt.zero_grad()
        return norm, False
    for o in getattr(opt, "chained_optimizers", [opt]):
        params = o.get_parameters()
        if clip > 0 and params:
            clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=norm)
    opt.step_with_ready_grads()
    return norm, True


def state_resetter(opt):
    """A function that makes megatron optimizer ``opt`` as it is now, fresh: Adam moments and step
    counts dropped (torch Adam keeps them per parameter, TE/apex FusedAdam's count is per group), the
    fp32 main copies of low-precision parameters copied again from the model's current weights, the
    fp16 loss scaler back to its initial state. The result is the optimizer a new
    :func:`adam_optimizer` would build over the same model, without allocating a second one."""
    parts = megatron_parts(opt)
    scalers = [dict(o.grad_scaler.state_dict()) if getattr(o, "grad_scaler", None) is not None else None for o in parts]

    def reset() -> None:
        for o, scaler in zip(parts, scalers):
            o.optimizer.state.clear()
            for g in o.optimizer.param_groups:
                g.pop("step", None)
            o.reload_model_params()
            if scaler is not None:
                o.grad_scaler.load_state_dict(scaler)

    return reset
