"""Device and process groups of the Megatron backend.

Layout: world = TP x CP x DP x PP (megatron's default order ``tp-cp-ep-dp-pp``: TP ranks are
adjacent); experts: world = expert-TP x EP x expert-DP x PP (EP ranks are carved out of CP x DP).
Every rank runs the same program.
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


def check_layout(world: int, tp: int, pp: int, cp: int, ep: int = 1, etp: int = 1) -> None:
    """megatron-core's divisibility rules of a layout over ``world`` ranks, as a ValueError naming the
    config keys: dense ranks TP x CP x DP x PP (world % (TP x CP x PP) == 0), expert ranks
    expert-TP x EP x expert-DP x PP (world % (ETP x EP x PP) == 0)."""
    if world % (tp * pp * cp):
        raise ValueError(
            f"the world of {world} ranks is not divisible by trainer.tensor_parallel x trainer.pipeline_parallel x "
            f"trainer.context_parallel = {tp} x {pp} x {cp}"
        )
    if world % (etp * ep * pp):
        raise ValueError(
            f"the world of {world} ranks is not divisible by trainer.expert_tensor_parallel x trainer.expert_parallel x "
            f"trainer.pipeline_parallel = {etp} x {ep} x {pp} (megatron lays experts out expert-TP x EP x expert-DP x PP)"
        )


def init_model_parallel(tp: int, pp: int, cp: int, ep: int = 1, etp: int | None = None) -> None:
    """(Re)initialise megatron's parallel_state for this layout. Experts: EP ranks x expert-TP
    ``etp`` (None: = TP, megatron-core's default) x expert-DP (the rest) x PP; see :func:`check_layout`."""
    from megatron.core import parallel_state as ps

    etp = tp if etp is None else etp
    check_layout(dist.get_world_size(), tp, pp, cp, ep, etp)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )
