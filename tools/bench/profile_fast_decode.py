#!/usr/bin/env python
"""Where the fast engine's decode step spends its GPU time: kernels of a profiled generate call.

    python tools/bench/profile_fast_decode.py                          # H200: qwen3-1.7b at batch 64, eager and compiled
    python tools/bench/profile_fast_decode.py --shape qwen2-0.5b --batch 256
    python tools/bench/profile_fast_decode.py --tiny                   # CPU: the code path (CPU op times)

Per variant (``eager``: the HF modules; ``compiled``: the per-layer pieces through torch.compile;
``_matmul``: the decode attention as two batched matmuls instead of SDPA, forward.py):

1. ``step_ms``: wall time per decode step of a generate call with CUDA graphs (as rollouts run);
2. a second engine with graphs off runs the same call under ``torch.profiler``: every kernel's time,
   grouped into ``gemm`` (matmul kernels), ``attention`` (SDPA kernels), ``vocab`` (kernels over the
   [B, V] logits after the LM head: softmax, the sampler's Gumbel argmax, sort) and ``other`` (the
   elementwise and copy kernels); ``kernels_per_step`` and ``kernel_ms_per_step`` (their sum over
   the call, the prompts' prefill included, divided by its decode steps: when it is close to
   ``step_ms`` the kernels themselves are the cost, not launch gaps);
3. the 20 kernels with the most time.

Prints ONE JSON line. Prompts are random (128 tokens), 64 sampled tokens each, EOS ignored.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from bench_rollout import build_model, free, requests  # noqa: E402
from common import Stopwatch, device_name, emit, stage_logger  # noqa: E402

say = stage_logger("profile_fast_decode")
GROUPS = (("attention", ("attention", "fmha", "flash", "sdpa", "_efficient")),
          ("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas", "matmul", "addmm", "mm_")),
          ("vocab", ("cumsum", "scan", "searchsorted", "softmax", "sort", "radix", "argmax", "reduce_kernel")))


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def engine(model, B: int, graphs: bool, opts: dict):
    from megaforge.rollout.embedded import EmbeddedEngine

    return EmbeddedEngine(model, None, max_batch=B, fast="on", fast_options={"graphs": graphs, **opts})


def step_time(model, reqs, B: int, opts: dict, dev) -> float:
    """Milliseconds per decode step of a graphed generate (after a warm-up call)."""
    eng = engine(model, B, dev.type == "cuda", opts)
    try:
        eng.generate(reqs)
        before = eng.fast.stats["decode_steps"]
        with Stopwatch(dev) as w:
            eng.generate(reqs)
        return 1e3 * w.seconds / max(1, eng.fast.stats["decode_steps"] - before)
    finally:
        eng.release_memory(["kv_cache", "cuda_graph"])
        del eng
        free(dev)


def kernel_profile(model, reqs, B: int, opts: dict, dev) -> dict:
    from torch.profiler import ProfilerActivity, profile

    eng = engine(model, B, False, opts)
    try:
        eng.generate(reqs)
        before = eng.fast.stats["decode_steps"]
        acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            eng.generate(reqs)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        steps = max(1, eng.fast.stats["decode_steps"] - before)
    finally:
        eng.release_memory(["kv_cache", "cuda_graph"])
        del eng
        free(dev)
    per_kernel = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        is_kernel = (ev.device_type == torch.autograd.DeviceType.CUDA) if dev.type == "cuda" else (
            ev.cpu_parent is None)
        if not is_kernel:
            continue
        us = ev.device_time if dev.type == "cuda" else ev.cpu_time
        per_kernel[ev.name][0] += us
        per_kernel[ev.name][1] += 1
    groups = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        groups[group_of(name)] += us
    total = sum(groups.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:20]
    return {"decode_steps": steps, "kernel_ms_per_step": round(total / 1e3 / steps, 3),
            "kernels_per_step": round(sum(n for _, n in per_kernel.values()) / steps, 1),
            "groups_ms_per_step": {g: round(us / 1e3 / steps, 3) for g, us in sorted(groups.items())},
            "top": [{"name": n[:120], "ms_per_step": round(us / 1e3 / steps, 4), "calls_per_step": round(c / steps, 2),
                     "group": group_of(n)} for n, (us, c) in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true", help="the eager variant only")
    ap.add_argument("--tiny", action="store_true", help="CPU: the tiny shape, batch 4, 8 new tokens")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        args.shape, args.batch, args.prompt, args.new = "tiny", 4, 16, 8
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_model(args.shape, dev, dtype)
    V = model.config.vocab_size
    prompts = torch.randint(3, V, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    reqs = requests(prompts, args.new)
    out = {"bench": "profile_fast_decode", "shape": args.shape, "batch": args.batch, "prompt_tokens": args.prompt,
           "sampled_tokens": args.new, "dtype": str(dtype).replace("torch.", ""), "variants": {}}
    variants = [("eager", {"attention": "sdpa"}), ("eager_matmul", {"attention": "matmul"})]
    if not args.no_compile and dev.type == "cuda":
        variants += [("compiled", {"compile": "inductor", "attention": "sdpa"}),
                     ("compiled_matmul", {"compile": "inductor", "attention": "matmul"})]
    for name, opts in variants:
        say(f"{name}: graphed step time")
        row = {"step_ms": round(step_time(model, reqs, args.batch, opts, dev), 3)}
        say(f"  {row['step_ms']} ms per step; profiling without graphs")
        row.update(kernel_profile(model, reqs, args.batch, opts, dev))
        say(f"  kernels {row['kernel_ms_per_step']} ms per step: {row['groups_ms_per_step']}")
        out["variants"][name] = row
    emit(out, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
