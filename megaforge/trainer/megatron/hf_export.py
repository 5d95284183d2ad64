"""Stream the policy as Hugging Face tensors: gather TP shards and PP stages, convert, bucket.

Order: the family table's order (embedding, layers 0..L-1, final norm, output layer; a tied output
layer is not exported). For each HF-exported Megatron parameter:

1. the owning pipeline stage's first DP/CP replica all-gathers its TP shards (TP group),
2. its TP rank 0 converts them to HF tensors (:func:`megaforge.convert.mapping.to_hf`),
3. if that stage is not stage 0, it sends them point-to-point to global rank 0, which allocated
   the receive buffers from shapes exchanged once up front.

Only global rank 0 (the engine feeder) ever holds HF tensors, one bucket at a time: never the whole
model. Every rank computes the same bucket boundaries from the exchanged shapes and yields the same
number of buckets (empty lists on every rank but 0), so callers may run collectives per bucket.
The generator issues collectives: every rank must consume it to the end.
"""
from __future__ import annotations

import copy
import os
import shutil
from typing import Iterator

import torch
import torch.distributed as dist

from megaforge.convert.mapping import hf_shapes, to_hf
from megaforge.trainer.megatron.model import local_param_maps

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


def _stage_of(pm, desc, pp: int) -> int:
    if pm.layer is not None:
        return pm.layer // (desc.num_layers // pp)
    return 0 if pm.megatron.startswith("embedding.") else pp - 1


def iter_hf_buckets(bm, max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of at most ``max_bytes`` (a bigger tensor is a bucket of its own); see module doc."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    first_replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    feeder = dist.get_rank() == 0
    rows = [pm for pm in bm.family.param_maps(bm.desc) if pm.export]
    params = dict(bm.model.named_parameters())
    local = {pm.megatron: name for name, pm in local_param_maps(bm).items()}  # this stage's rows
    dtype = next(iter(params.values())).dtype
    # shard shapes of every exported row, from the stage that owns it
    mine = {pm.megatron: tuple(params[local[pm.megatron]].shape) for pm in rows if pm.megatron in local}
    if pp > 1:
        everyone = [None] * pp
        dist.all_gather_object(everyone, mine, group=ps.get_pipeline_model_parallel_group())
        shapes = {k: v for d in everyone for k, v in d.items()}
    else:
        shapes = mine
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()) if pp > 1 else [0]
    elem = torch.empty((), dtype=dtype).element_size()
    device = next(iter(params.values())).device

    bucket, size = [], 0
    for pm in rows:
        stage = _stage_of(pm, bm.desc, pp)
        out_shapes = hf_shapes(pm, shapes[pm.megatron], tp, bm.dims)
        nbytes = sum(int(torch.Size(s).numel()) for s in out_shapes) * elem
        if size and size + nbytes > max_bytes:
            yield bucket if feeder else []
            bucket, size = [], 0
        tensors = None
        if stage == pp_rank and first_replica:
            shard = params[local[pm.megatron]].detach()
            if tp > 1:
                parts = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
            else:
                parts = [shard]
            if tp_rank == 0:
                tensors = to_hf(pm, parts, bm.dims)
                if stage != 0:
                    for _, t in tensors:
                        dist.send(t.contiguous(), dst=pp_ranks[0], group=ps.get_pipeline_model_parallel_group())
        if feeder and stage != 0:
            tensors = []
            for name, s in zip(pm.hf, out_shapes):
                buf = torch.empty(s, dtype=dtype, device=device)
                dist.recv(buf, src=pp_ranks[stage], group=ps.get_pipeline_model_parallel_group())
                tensors.append((name, buf))
        if feeder:
            bucket.extend(tensors)
        size += nbytes
    if size:
        yield bucket if feeder else []


def export_hf(bm, hf_config, path: str, tokenizer=None, model_path: str = "", max_shard_bytes: int = 2 << 30) -> None:
    """Write a transformers-loadable directory (safetensors shards + index, config, tokenizer) via
    :func:`iter_hf_buckets`; atomic: written to ``path + '.tmp'`` and renamed. Collective."""
    from safetensors.torch import save_file

    path = os.path.abspath(path.rstrip("/"))
    tmp = path + ".tmp"
    feeder = dist.get_rank() == 0
    if feeder:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    files, weight_map = [], {}
    for bucket in iter_hf_buckets(bm, max_shard_bytes):
        if not feeder:
            continue
        fname = f"part-{len(files):05d}.safetensors"
        save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in bucket}, os.path.join(tmp, fname),
                  metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({n: fname for n, _ in bucket})
    if feeder:
        _finish_dir(tmp, path, files, weight_map, hf_config, bm, tokenizer, model_path)
    dist.barrier()


def _finish_dir(tmp, path, files, weight_map, hf_config, bm, tokenizer, model_path):
    import json

    n = len(files)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for old, new in zip(files, names):
        os.replace(os.path.join(tmp, old), os.path.join(tmp, new))
    if n > 1:
        rename = dict(zip(files, names))
        total = sum(os.path.getsize(os.path.join(tmp, f)) for f in names)
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": {k: rename[v] for k, v in sorted(weight_map.items())}}, f, indent=2)
    cfg = copy.deepcopy(hf_config)
    cfg.dtype = next(bm.model.parameters()).dtype
    cfg.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    elif model_path and os.path.isdir(model_path):
        for f in _TOKENIZER_FILES:
            if os.path.exists(os.path.join(model_path, f)):
                shutil.copy(os.path.join(model_path, f), os.path.join(tmp, f))
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
