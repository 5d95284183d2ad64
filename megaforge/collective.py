"""Small torch.distributed helpers; everything works unchanged in a single process."""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from megaforge.data.batch import shard_range as split_range
from megaforge.hf import DeviceError


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world() -> int:
    return dist.get_world_size() if initialized() else 1


def is_main() -> bool:
    return rank() == 0


def init_from_env(device_type: str, timeout_s: float = 1800.0) -> None:
    """Initialise the default process group from torchrun's variables (no-op when absent)."""
    if initialized() or "WORLD_SIZE" not in os.environ:
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        have = torch.cuda.device_count()
        if local_world > have:
            raise DeviceError(f"{local_world} processes per node (torchrun --nproc_per_node) but this node has "
                               f"{have} GPU(s): lower --nproc_per_node to {have}, or set trainer.device cpu")
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def barrier() -> None:
    if initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not initialized() or world() == 1:
        return obj
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def main_flag(flag: bool) -> bool:
    """The main rank's ``flag`` on every rank (the others pass anything; one float all-reduced)."""
    t = torch.tensor([float(bool(flag)) if is_main() else 0.0])
    return bool(all_reduce_sum(t).item() > 0)


def _staged(t: torch.Tensor, group=None) -> torch.Tensor:
    """``t`` where the group's backend can move it: on the GPU for NCCL, as it is for gloo."""
    if dist.get_backend(group) == "nccl" and t.device.type != "cuda":
        return t.cuda()
    return t


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    if initialized() and world() > 1:
        dev = t.device
        t = _staged(t)
        dist.all_reduce(t, op=op)
        t = t.to(dev)
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Elementwise sum of ``t`` over the world, on every rank (on ``t``'s device; in place for gloo)."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``t`` over the world, on every rank (as :func:`all_reduce_sum`)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def broadcast_tensor(t: torch.Tensor | None, shape, dtype: torch.dtype, src: int = 0) -> torch.Tensor:
    """Global rank ``src``'s ``t`` on every rank, as a host tensor; the others pass None and the
    ``shape`` and ``dtype`` it has."""
    if rank() == src and (tuple(t.shape) != tuple(shape) or t.dtype != dtype):
        raise ValueError(f"broadcast_tensor: the tensor is {tuple(t.shape)} {t.dtype}, announced {tuple(shape)} {dtype}")
    if not initialized() or world() == 1:
        return t
    buf = _staged((t if rank() == src else torch.empty(shape, dtype=dtype)).contiguous())
    dist.broadcast(buf, src=src)
    return buf.cpu()


def send_tensor(t: torch.Tensor, dst: int) -> None:
    """Point to point: ``t`` to global rank ``dst``, which calls :func:`recv_tensor` with its shape and dtype."""
    dist.send(_staged(t.contiguous()), dst=dst)


def recv_tensor(shape, dtype: torch.dtype, src: int) -> torch.Tensor:
    """Point to point: a host tensor of ``shape`` and ``dtype`` from global rank ``src``'s :func:`send_tensor`."""
    buf = _staged(torch.empty(shape, dtype=dtype))
    dist.recv(buf, src=src)
    return buf.cpu()


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same count on every rank), indexed by global rank."""
    if not initialized() or world() == 1:
        return [list(values)]
    buf = _staged(torch.tensor(values, dtype=torch.long))
    parts = [torch.empty_like(buf) for _ in range(world())]
    dist.all_gather(parts, buf)
    return [p.cpu().tolist() for p in parts]


def shard_range(n: int, r: int | None = None, w: int | None = None) -> tuple[int, int]:
    """Contiguous rows [lo, hi) of ``n`` owned by rank ``r`` of ``w`` (sizes differ by at most 1)."""
    return split_range(n, rank() if r is None else r, world() if w is None else w)


def all_gather_rows(t: torch.Tensor, n_total: int, group=None) -> torch.Tensor:
    """Concatenate each rank's contiguous row shard ([n_r, ...]) into [n_total, ...] on every rank."""
    if not initialized() or world() == 1:
        return t
    w = dist.get_world_size(group)
    sizes = [shard_range(n_total, r, w) for r in range(w)]
    biggest = max(hi - lo for lo, hi in sizes)
    pad = torch.zeros((biggest,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    pad[: t.shape[0]] = t
    pad = _staged(pad, group)
    parts = [torch.empty_like(pad) for _ in range(w)]
    dist.all_gather(parts, pad, group=group)
    return torch.cat([p[: hi - lo].to(t.device) for p, (lo, hi) in zip(parts, sizes)], dim=0)
