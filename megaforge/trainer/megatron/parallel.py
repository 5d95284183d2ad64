"""Process groups and device for the Megatron backend.

Layout: world = TP x CP x DP x PP (megatron's default order ``tp-cp-ep-dp-pp``: TP ranks are
adjacent). Every rank runs the same program; the helpers below name a rank's coordinates.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def pick_device(setting: str) -> torch.device:
    """``trainer.device`` (auto | cpu | cuda | cuda:N) -> torch.device; CUDA uses LOCAL_RANK."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"trainer.device={setting!r} but CUDA is not available")
        idx = int(setting.split(":")[1]) if ":" in setting else int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    if setting != "cpu":
        raise ValueError(f"trainer.device={setting!r}; valid: auto, cpu, cuda, cuda:N")
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device) -> None:
    """Join torchrun's process group (env RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), or start a
    one-process group when run without torchrun. nccl on CUDA, gloo on CPU."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=int(os.environ.get("MEGAFORGE_DIST_TIMEOUT_MIN", "30")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, timeout=timeout)


def init_model_parallel(tp: int, pp: int, cp: int, ep: int = 1) -> None:
    """(Re)initialise megatron's parallel_state for this layout."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel x pipeline_parallel x "
            f"context_parallel = {tp} x {pp} x {cp}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )


def coords() -> dict[str, int]:
    """This rank's (tp, cp, dp, pp) ranks and sizes."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        cp=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
    )
