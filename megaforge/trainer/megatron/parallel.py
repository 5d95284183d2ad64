"""Device and process groups of the Megatron backend.

Layout: world = TP x CP x DP x PP (megatron's default order ``tp-cp-ep-dp-pp``: TP ranks are
adjacent). Every rank runs the same program.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from megaforge import collective
from megaforge.hf import resolve_device


def pick_device(setting: str) -> torch.device:
    """``trainer.device`` -> torch.device; a bare ``cuda`` means this process's LOCAL_RANK GPU."""
    device = resolve_device(setting)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return device


def init_distributed(device: torch.device) -> None:
    """Join torchrun's process group (as the loop does), or, without torchrun, start a one-process
    group on a free local port: megatron needs one either way. nccl on CUDA, gloo on CPU."""
    collective.init_from_env(device.type)
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def init_model_parallel(tp: int, pp: int, cp: int, ep: int = 1, etp: int | None = None) -> None:
    """(Re)initialise megatron's parallel_state for this layout. Experts: EP ranks x expert-TP
    ``etp`` (None: = TP, megatron's default) x expert-DP (the rest) x PP."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel x pipeline_parallel x "
            f"context_parallel = {tp} x {pp} x {cp}"
        )
    etp = tp if etp is None else etp
    if world % (etp * ep * pp):
        raise ValueError(
            f"world size {world} is not divisible by expert_tensor_parallel x expert_parallel x "
            f"pipeline_parallel = {etp} x {ep} x {pp}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )
