"""Throughput of the HF bucket iterator (Megatron shards -> HF tensors on global rank 0) beside a
plain device-to-device copy of the same bytes.

    python tools/bench/bench_convert.py --hf-config configs/models/qwen3-1.7b                    # 1 GPU, TP=1
    torchrun --nproc_per_node 2 tools/bench/bench_convert.py --hf-config configs/models/qwen3-1.7b --tp 2
    python tools/bench/bench_convert.py --tiny                                                   # CPU smoke run

The model is the GPTModel of an HF config (``--hf-config``: a directory with ``config.json``; the
repo's ``configs/models/qwen3-1.7b`` is Qwen3-1.7B, 2.0 B parameters with the untied embedding)
built at the layout (``--tp``, ``--pp``; remaining ranks data-parallel) in ``--dtype`` with
uninitialised weights (values do not matter for bandwidth). One pass of
:func:`megaforge.trainer.megatron.hf_export.iter_hf_buckets` gathers every TP shard, converts it to
HF layout (fused qkv split per group, gate/up halves, vocabulary unpadded) and, for rows owned by
another rank, sends it to rank 0, bucketed at ``--bucket-mb``; rank 0 consumes each bucket (the
tensors stay on the device, as a weight update to a colocated engine would read them). Timed over
``--repeats`` passes after ``--warmup`` (the first pass also exchanges the shard table).

Baseline: ``dst.copy_(src)`` of one device buffer holding the same number of bytes on rank 0.
Prints one JSON line (rank 0): bytes, seconds and GB/s (10^9 B/s) of both, their ratio, layout.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import device_name, emit, model_config, time_per_call  # noqa: E402

TINY_MOE = dict(  # --tiny: a Qwen3-MoE small enough for the CPU, vocabulary padded at TP=1 (509 -> 512)
    model_type="qwen3_moe", vocab_size=509, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4,
    num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-config", "--hf_config", dest="hf_config", default="configs/models/qwen3-1.7b",
                   help="directory with an HF config.json, or a name under configs/models/")
    p.add_argument("--tiny", action="store_true", help="tiny Qwen3-MoE config on CPU (smoke run)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: --tp)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--bucket-mb", "--bucket_mb", dest="bucket_mb", type=float, default=512.0)
    p.add_argument("--layer_spec", default="auto", choices=["auto", "te", "torch"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    if a.tiny:
        a.device, a.dtype, a.layer_spec, a.bucket_mb, a.repeats = "cpu", "float32", "torch", 0.05, 2
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from megaforge.convert.ranks import Layout
    from megaforge.trainer.megatron import convert as mconvert
    from megaforge.trainer.megatron import model as mmodel
    from megaforge.trainer.megatron.hf_export import iter_hf_buckets

    hf_config = model_config(TINY_MOE if args.tiny else args.hf_config)
    layout = Layout(args.tp, args.pp, args.ep, args.etp)
    device = mconvert.setup(layout, args.device)
    dtype = getattr(torch, args.dtype)
    bm = mconvert.build(hf_config, layout, dtype, device, mmodel.resolve_spec(args.layer_spec))
    n_params = sum(p.numel() for p in bm.model.parameters())
    limit = int(args.bucket_mb * (1 << 20))
    rank0 = dist.get_rank() == 0
    passes = []  # (HF bytes, buckets, largest bucket's bytes) of each pass

    def one_pass():
        nbytes, buckets, largest = 0, 0, 0
        for bucket in iter_hf_buckets(bm, limit):
            buckets += 1
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            nbytes += size
            largest = max(largest, size)
        passes.append((nbytes, buckets, largest))

    iter_s = time_per_call(one_pass, args.warmup, args.repeats, device)  # the slowest rank's
    nbytes, buckets, largest = passes[-1]

    if rank0:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_s = time_per_call(lambda: dst.copy_(src), 1, args.repeats, device, across_ranks=False)
        emit({
            "model": "tiny-qwen3-moe" if args.tiny else os.path.basename(os.path.abspath(args.hf_config)),
            "family": bm.family.name, "dtype": args.dtype, "device": str(device.type),
            "gpu": device_name(device) if device.type == "cuda" else None,
            "world": dist.get_world_size(), "tp": args.tp, "pp": args.pp, "ep": args.ep, "etp": args.etp or args.tp, "layer_spec": bm.spec,
            "params_rank0": n_params, "hf_bytes": nbytes, "bucket_mb": args.bucket_mb, "buckets": buckets,
            "largest_bucket_bytes": largest,
            "iter_s": round(iter_s, 6), "iter_gbps": round(nbytes / iter_s / 1e9, 3),
            "copy_s": round(copy_s, 6), "copy_gbps": round(nbytes / copy_s / 1e9, 3),
            "iter_vs_copy": round(copy_s / iter_s, 4),
        }, device)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
