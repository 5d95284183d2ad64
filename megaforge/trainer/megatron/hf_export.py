"""Stream the live, sharded policy as Hugging Face tensors, bucketed: gather TP / expert-TP shards,
collect pipeline stages and expert-parallel ranks on global rank 0, convert, and export.

Rows are the family table's exported rows in table order (embedding, layers 0..L-1 with, in MoE
layers, router then experts 0..E-1, final norm, output layer; a tied output layer is not exported).
Every row has one *owner*: the rank that holds its shard of rank 0 in the row's shard group (TP
group; expert-TP group for expert weights) on the first replica (DP = CP = 0; expert-DP = 0 for
experts), on the pipeline stage / expert-parallel rank that holds the row. Up front, owners
publish ``(shard shape, dtype, owner rank)`` of their rows (one ``all_gather_object``), so every
rank can compute the same bucket boundaries and rank 0 can allocate receive buffers. Then, row by
row:

1. the owner's shard group all-gathers the shards (skipped when the group has one rank),
2. the owner converts them to HF tensors (:func:`megaforge.convert.mapping.to_hf`),
3. an owner other than global rank 0 sends them point-to-point to rank 0.

Only global rank 0 (the engine feeder / writer) ever holds HF tensors, one bucket at a time: never
the whole model; other ranks hold at most one row's gathered tensors. Every rank yields the same
number of buckets (empty lists on every rank but 0), so callers may run collectives per bucket.
A bucket holds at most ``max_bytes`` of HF tensors, except a single tensor larger than that (the
HF tensors of one row, e.g. q / k / v of a fused qkv, may land in different buckets). The
generator issues collectives: every rank must consume it to the end. Deadlock freedom: all ranks
walk the rows in the same order and every blocking operation of row k involves only row k's
participants.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megaforge.convert.hf_writer import DEFAULT_MAX_SHARD_BYTES, HFWriter
from megaforge.convert.mapping import hf_shapes, to_hf
from megaforge.trainer.megatron.model import local_param_maps, shard_group


def _groups(pm):
    """(shard group or None, is this rank on the row's first replica) for row ``pm``."""
    from megatron.core import parallel_state as ps

    if pm.expert is not None:
        group = ps.get_expert_tensor_parallel_group() if ps.get_expert_tensor_parallel_world_size() > 1 else None
        return group, ps.get_expert_data_parallel_rank() == 0
    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    return group, ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def row_owners(bm) -> tuple[list, dict]:
    """(exported rows in table order, {megatron name: (shard shape, dtype name, owner rank)}) —
    identical on every rank. Collective (one ``all_gather_object`` over the world) the first time;
    cached on ``bm`` after."""
    if bm.export_plan is not None:
        return bm.export_plan
    rows = [pm for pm in bm.family.param_maps(bm.desc) if pm.export]
    params = dict(bm.model.named_parameters())
    local = {pm.megatron: name for name, pm in local_param_maps(bm).items()}
    me = dist.get_rank()
    mine = {}
    for pm in rows:
        if pm.megatron not in local:
            continue
        _, first = _groups(pm)
        if first and shard_group(pm)[1] == 0:
            p = params[local[pm.megatron]]
            mine[pm.megatron] = (tuple(p.shape), str(p.dtype).removeprefix("torch."), me)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    owners = {}
    for d in everyone:
        for k, v in d.items():
            if k in owners:
                raise RuntimeError(f"{k}: owned by ranks {owners[k][2]} and {v[2]} (layout bug)")
            owners[k] = v
    missing = [pm.megatron for pm in rows if pm.megatron not in owners]
    if missing:
        raise RuntimeError(f"no rank holds {missing[:5]}{' ...' if len(missing) > 5 else ''} (layout bug)")
    bm.export_plan = (rows, owners)
    return rows, owners


def iter_hf_buckets(bm, max_bytes: int, values: Optional[dict] = None,
                    merge: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None
                    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most ``max_bytes`` (a bigger tensor is a bucket of its own); see module doc.
    ``values``: {this rank's parameter name: tensor of that parameter's shape and dtype} streamed
    instead of the weights, through the same gathers and conversion (e.g. the reduced gradients,
    whose layout is the parameters'). ``merge(name, shard) -> shard``: applied to each local shard
    before the gather, one row at a time (LoRA: W + s B A, megaforge.trainer.megatron.lora); LoRA
    adapter parameters themselves are never streamed."""
    from megatron.core import parallel_state as ps

    rows, owners = row_owners(bm)
    tp, etp = ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    params = {n: p for n, p in bm.model.named_parameters() if ".lora." not in n}
    if values is not None:
        for name, p in params.items():
            v = values[name]
            if v.shape != p.shape or v.dtype != p.dtype:
                raise ValueError(f"iter_hf_buckets: {name} given as {tuple(v.shape)} {v.dtype}, the parameter is "
                                 f"{tuple(p.shape)} {p.dtype}")
        params = values
    local = {pm.megatron: name for name, pm in local_param_maps(bm).items()}
    me = dist.get_rank()
    feeder = me == 0
    device = next(iter(params.values())).device

    bucket, size = [], 0
    for pm in rows:
        shape, dtype_name, owner = owners[pm.megatron]
        dtype = getattr(torch, dtype_name)
        n = etp if pm.expert is not None else tp  # shards per row (same on every rank)
        out_shapes = hf_shapes(pm, shape, n, bm.dims)
        tensors: Optional[list] = None
        if pm.megatron in local:
            group, first = _groups(pm)
            if first:
                shard = params[local[pm.megatron]].detach()
                if merge is not None:
                    shard = merge(local[pm.megatron], shard)
                if n > 1:
                    parts = [torch.empty_like(shard) for _ in range(n)]
                    dist.all_gather(parts, shard.contiguous(), group=group)
                else:
                    parts = [shard]
                if me == owner:
                    tensors = to_hf(pm, parts, bm.dims)
                    if owner != 0:
                        for _, t in tensors:
                            dist.send(t.contiguous(), dst=0)
                        tensors = None
                del parts
        if feeder and owner != 0:
            tensors = []
            for name, s in zip(pm.hf, out_shapes):
                buf = torch.empty(s, dtype=dtype, device=device)
                dist.recv(buf, src=owner)
                tensors.append((name, buf))
        # bucket boundaries per HF tensor, from shapes every rank knows
        for j, s in enumerate(out_shapes):
            nbytes = int(torch.Size(s).numel()) * dtype.itemsize
            if size and size + nbytes > max_bytes:
                yield bucket if feeder else []
                bucket, size = [], 0
            if feeder:
                bucket.append(tensors[j])
            size += nbytes
    if size:
        yield bucket if feeder else []


def export_hf(bm, hf_config, path: str, tokenizer=None, model_path: str = "",
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, bucket_bytes: int = 512 << 20,
              dtype: Optional[torch.dtype] = None, overwrite: bool = True,
              merge: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None) -> None:
    """Write a transformers-loadable directory (safetensors shards + index, config, generation
    config, tokenizer) from :func:`iter_hf_buckets` through :class:`HFWriter` on rank 0: atomic
    (temporary folder next to ``path``, renamed at the end, removed on error). Device memory on rank
    0 is bounded by ``bucket_bytes``, host memory by ``max_shard_bytes``; ``merge``: as in
    :func:`iter_hf_buckets` (LoRA: the merged weights). Collective."""
    feeder = dist.get_rank() == 0
    writer = HFWriter(path, max_shard_bytes, dtype, overwrite) if feeder else None
    try:
        for bucket in iter_hf_buckets(bm, bucket_bytes, merge=merge):
            if feeder:
                writer.add_bucket(bucket)
        if feeder:
            writer.finish(hf_config, tokenizer, model_path)
    finally:
        if writer is not None:
            writer.abort()  # no-op after finish
    dist.barrier()
