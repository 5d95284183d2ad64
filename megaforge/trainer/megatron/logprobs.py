"""Per-token log-probabilities and entropy from vocabulary-parallel logits, without gathering them.

Each TP rank holds logits z [N, V/tp] for its slice of the (padded) vocabulary. With temperature
tau, z <- z / tau, and only the first ``vocab`` (unpadded) columns taking part:

    m      = max_v z_v                         (all-reduce MAX over TP)
    S      = sum_v exp(z_v - m)                (all-reduce SUM)
    logZ   = m + log S
    lp     = z_y - logZ                        (z_y all-reduce SUM from the rank owning label y)
    H      = logZ - sum_v p_v z_v,  p = exp(z - logZ)   (all-reduce SUM)

Backward (local, no communication): dlp/dz_v = 1[v = y] - p_v, dH/dz_v = -p_v (z_v - logZ + H);
each rank returns the gradient for its own columns (then divided by tau), which is exactly the
gradient of the replicated per-token values with respect to the sharded logits.

Memory traffic: on CUDA the two [N, V/tp] passes (the sums, the gradient) run as torch.compile'd
kernels that read the bf16 logits and write the bf16 gradient once; computed op by op they make
~16 GB of float32 temporaries per micro-batch of 4096 tokens x 32k vocabulary. Only the bf16
logits are kept for backward (not a float32 copy).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _exp_sums(logits: torch.Tensor, m: torch.Tensor, n_valid: int):
    """S [N] = sum_v exp(z_v - m) and sum_v exp(z_v - m) z_v [N] (float32) over the first
    ``n_valid`` columns of logits [N, V/tp]."""
    z = logits[:, :n_valid].float()
    e = torch.exp(z - m[:, None])
    return e.sum(-1), (e * z).sum(-1)


def _logits_grad(logits, logz, ent, g_lp, g_ent, local, own, n_valid: int):
    """dL/dz [N, V/tp] in logits' dtype, p_v = exp(z_v - logZ):
    g_lp (1[v = y] - p_v) - g_ent p_v (z_v - logZ + H) on the first ``n_valid`` columns, 0 beyond;
    a term whose incoming gradient is None (e.g. a detached entropy) is left out."""
    z = logits.float()
    col = torch.arange(z.shape[1], device=z.device)[None, :]
    p = torch.exp(z - logz[:, None])
    if g_lp is None:
        grad = torch.zeros_like(p)
    else:
        onehot = ((col == local[:, None]) & own[:, None]).float()
        grad = g_lp[:, None] * (onehot - p)
    if g_ent is not None:
        grad = grad - g_ent[:, None] * p * (z - logz[:, None] + ent[:, None])
    return torch.where(col < n_valid, grad, torch.zeros((), device=z.device)).to(logits.dtype)


# A cache, not run state: one compiled kernel per module-level function for the process (compiling again per
# trainer would only cost time; the result does not depend on who asks).
_COMPILED: dict = {}


def _kernel(fn, fused: bool):
    """``fn`` itself (eager), or its torch.compile'd form: one fused pass over the logits instead
    of a float32 temporary per operation."""
    if not fused:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED[fn]


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, n_valid, group, with_entropy, fused):
        n = logits.shape[0]
        if n_valid > 0:
            m = logits[:, :n_valid].max(-1).values.float()  # exact in any float dtype
        else:
            m = torch.full((n,), float("-inf"), device=logits.device)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        local = labels - vocab_start
        own = (local >= 0) & (local < n_valid)
        if n_valid > 0:
            s, pz = _kernel(_exp_sums, fused)(logits, m, n_valid)
            zy = torch.where(own, logits.gather(-1, local.clamp(0, n_valid - 1)[:, None])[:, 0].float(), 0.0)
        else:
            s = pz = zy = torch.zeros(n, device=logits.device)
        stats = torch.stack([s, zy, pz] if with_entropy else [s, zy])
        if group is not None:
            dist.all_reduce(stats, group=group)
        logz = m + torch.log(stats[0])
        lp = stats[1] - logz
        ent = (logz - stats[2] / stats[0]) if with_entropy else torch.zeros_like(lp)
        ctx.save_for_backward(logits, logz, ent, local, own)
        ctx.meta = (n_valid, fused)
        ctx.set_materialize_grads(False)  # a detached entropy costs no backward pass over [N, V]
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, logz, ent, local, own = ctx.saved_tensors
        n_valid, fused = ctx.meta
        grad = _kernel(_logits_grad, fused)(logits, logz, ent, g_lp, g_ent, local, own, n_valid)
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab: int, temperature: float = 1.0,
                            group=None, with_entropy: bool = True,
                            fused: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of ``labels`` [N] and entropy [N] (float32) from this rank's logits [N, V/tp].

    ``vocab`` is the real (unpadded) vocabulary size; columns at or beyond it are ignored. Labels
    must lie in [0, vocab) (the caller checks, on the host: a check here would sync the device).
    ``group`` is the TP group (None: logits hold the whole vocabulary). ``fused``: the sums and the
    gradient through torch.compile'd kernels (None: when the logits are on CUDA).
    """
    width = logits.shape[-1]
    rank = 0 if group is None else dist.get_rank(group)
    start = rank * width
    n_valid = max(0, min(width, vocab - start))
    z = logits if temperature == 1.0 else logits / temperature
    fused = logits.is_cuda if fused is None else fused
    return _VocabParallelLogprobEntropy.apply(z, labels, start, n_valid, group, with_entropy, fused)


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, vocab: int, group=None) -> torch.Tensor:
    """Index [N] of the largest logit over the real vocabulary from this rank's logits [N, V/tp]
    (ties: the lowest index)."""
    width = logits.shape[-1]
    rank = 0 if group is None else dist.get_rank(group)
    n_valid = max(0, min(width, vocab - rank * width))
    z = logits[:, :n_valid].float()
    if n_valid:
        val, idx = z.max(-1)
    else:
        val = torch.full((z.shape[0],), float("-inf"), device=z.device)
        idx = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    idx = idx + rank * width
    if group is None:
        return idx
    tp = dist.get_world_size(group)
    vals = [torch.empty_like(val) for _ in range(tp)]
    idxs = [torch.empty_like(idx) for _ in range(tp)]
    dist.all_gather(vals, val, group=group)
    dist.all_gather(idxs, idx, group=group)
    best = torch.stack(vals).argmax(0)  # first rank holding the maximum
    return torch.stack(idxs).gather(0, best[None])[0]
