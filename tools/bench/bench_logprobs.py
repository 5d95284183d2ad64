"""The per-token logprob/entropy pass over the vocabulary, fused (torch.compile'd kernels) vs eager.

    python tools/bench/bench_logprobs.py                      # CUDA: 4096 tokens x Qwen's 151,936 vocabulary
    python tools/bench/bench_logprobs.py --tokens 64 --vocab 1000   # CPU smoke run

Forward + backward of ``vocab_parallel_logprobs`` (logprob and entropy both carrying a gradient)
on the same bf16 logits both ways; prints one JSON line: the largest differences (logprob, entropy,
gradient relative to its largest entry), milliseconds per pass and the peak memory each adds above
the logits.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import PeakMemory, device_name, emit, time_per_call  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args(argv)
    from megaforge.trainer.megatron.logprobs import vocab_parallel_logprobs

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    N, V = a.tokens, a.vocab
    x = (3 * torch.randn(N, V, device=dev)).bfloat16()
    y = torch.randint(0, V, (N,), device=dev)
    w1, w2 = torch.randn(N, device=dev), torch.randn(N, device=dev)
    out = {}
    for fused in (False, True):
        logits = x.clone().requires_grad_(True)

        def step():
            logits.grad = None
            lp, ent = vocab_parallel_logprobs(logits, y, V, fused=fused)
            ((lp * w1).sum() + (ent * w2).sum()).backward()
            last[:] = lp.detach(), ent.detach()

        last = [None, None]
        with PeakMemory(dev) as peak:
            ms = time_per_call(step, a.warmup, a.iters, dev) * 1e3
        out[fused] = (*last, logits.grad.float(), ms, peak.above_start_gib)
    e, f = out[False], out[True]
    emit({
        "tool": "bench_logprobs", "device": device_name(dev), "tokens": N, "vocab": V,
        "lp_max_diff": float((e[0] - f[0]).abs().max()), "entropy_max_diff": float((e[1] - f[1]).abs().max()),
        "grad_max_rel_diff": float((e[2] - f[2]).abs().max() / e[2].abs().max()),
        "eager_ms": round(e[3], 3), "fused_ms": round(f[3], 3), "speedup": round(e[3] / f[3], 2),
        "eager_extra_peak_gib": None if e[4] is None else round(e[4], 3),
        "fused_extra_peak_gib": None if f[4] is None else round(f[4], 3),
    }, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
