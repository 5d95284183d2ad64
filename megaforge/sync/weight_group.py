"""The process group of ``/init_weights_update_group`` + ``/update_weights_from_distributed``.

Same construction as sglang's ``init_custom_process_group`` (``srt/utils/common.py``), so a
megaforge trainer (rank 0) and SGLang engines (ranks ``rank_offset + tp_rank``) meet in one group:
TCP rendezvous at ``tcp://master_address:master_port`` (rank 0 hosts the store), keys under
``PrefixStore(group_name)``, a group that is not the default one (no ``init_process_group``
needed). Backend ``nccl`` on GPUs, ``gloo`` on CPU.

A bucket crosses the group as in sglang 0.5.23: with ``load_format: "flattened_bucket"`` one
broadcast from rank 0 of a uint8 buffer laid out as :func:`layout` computes (tensors back to back in
the request's order, each start aligned for its dtype); with ``load_format: null`` one broadcast per
tensor, in order.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def init_custom_process_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                              group_name: str, timeout_s: float = 600.0, connect_timeout_s: Optional[float] = None):
    """The group (see the module docstring). ``connect_timeout_s`` bounds reaching the TCP store at
    ``master_address:master_port`` (a closed port fails after it, naming the address); ``timeout_s`` the
    group's set-up and collectives afterwards. None: ``timeout_s`` for both."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    connect = timedelta(seconds=connect_timeout_s if connect_timeout_s is not None else timeout_s)
    try:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=connect))
    except (RuntimeError, OSError) as e:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        raise ConnectionError(f"cannot reach the weight-update group's store at {master_address}:{master_port} "
                              f"within {connect.total_seconds():g} s: {type(e).__name__}: {e}") from e
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy(pg) -> None:
    dist.destroy_process_group(pg)


def parse_dtype(name: str, where: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return d


def layout(names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[tuple[str, torch.dtype, torch.Size, int, int]], int]:
    """[(name, dtype, shape, start, end)] and the total bytes, as ``FlattenedTensorBucket.empty``."""
    out, off = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        shape = torch.Size(shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in tensor {name!r}: {tuple(shape)}")
        itemsize = torch.empty((), dtype=dt).element_size()
        if off % itemsize:
            raise ValueError(f"unaligned tensor {name!r}: byte offset {off}, dtype {dt}")
        n = shape.numel() * itemsize
        out.append((name, dt, shape, off, off + n))
        off += n
    return out, off


def receive(pg, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], flattened: bool,
            device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket broadcast from rank 0 (the engine side)."""
    if flattened:
        lay, total = layout(names, dtypes, shapes)
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=0, group=pg)
        return [(n, buf[s:e].view(dt).reshape(shape)) for n, dt, shape, s, e in lay]
    out = []
    for n, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=dt, device=device)
        dist.broadcast(t, src=0, group=pg)
        out.append((n, t))
    return out


def send(pg, flat: Optional[torch.Tensor] = None, tensors: Optional[list[torch.Tensor]] = None) -> None:
    """Broadcast one bucket from rank 0 (the trainer side): the flat buffer, or each tensor in order."""
    if flat is not None:
        dist.broadcast(flat, src=0, group=pg)
        return
    for t in tensors or []:
        dist.broadcast(t.contiguous(), src=0, group=pg)
