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
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, n_valid, group, with_entropy):
        z = logits.float()[:, :n_valid]  # [N, n_valid] real vocabulary columns of this rank
        n = z.shape[0]
        if n_valid > 0:
            m = z.max(-1).values
        else:
            m = torch.full((n,), float("-inf"), device=z.device)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - m[:, None])
        s = e.sum(-1)
        local = labels - vocab_start
        own = (local >= 0) & (local < n_valid)
        if n_valid > 0:
            zy = torch.where(own, z.gather(-1, local.clamp(0, n_valid - 1)[:, None])[:, 0], 0.0)
        else:
            zy = torch.zeros(n, device=z.device)
        if with_entropy:
            pz = (e * z).sum(-1)
            stats = torch.stack([s, zy, pz])
        else:
            stats = torch.stack([s, zy])
        if group is not None:
            dist.all_reduce(stats, group=group)
        logz = m + torch.log(stats[0])
        lp = stats[1] - logz
        ent = (logz - stats[2] / stats[0]) if with_entropy else torch.zeros_like(lp)
        ctx.save_for_backward(z, logz, ent, local, own)
        ctx.meta = (logits.shape[-1], n_valid, logits.dtype)
        ctx.set_materialize_grads(False)  # a detached entropy costs no backward pass over [N, V]
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        z, logz, ent, local, own = ctx.saved_tensors
        width, n_valid, dtype = ctx.meta
        p = torch.exp(z - logz[:, None])
        if g_lp is not None:
            grad = p * (-g_lp[:, None])
            if n_valid:  # + g at the label's column, on the rank that owns it (no host sync)
                grad.scatter_add_(1, local.clamp(0, n_valid - 1)[:, None], (g_lp * own)[:, None])
        else:
            grad = torch.zeros_like(p)
        if g_ent is not None:
            grad -= p * (z - logz[:, None] + ent[:, None]) * g_ent[:, None]
        if n_valid < width:
            grad = torch.cat([grad, grad.new_zeros(grad.shape[0], width - n_valid)], -1)
        return grad.to(dtype), None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab: int, temperature: float = 1.0,
                            group=None, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of ``labels`` [N] and entropy [N] (float32) from this rank's logits [N, V/tp].

    ``vocab`` is the real (unpadded) vocabulary size; columns at or beyond it are ignored. Labels
    must lie in [0, vocab) (the caller checks, on the host: a check here would sync the device).
    ``group`` is the TP group (None: logits hold the whole vocabulary).
    """
    width = logits.shape[-1]
    rank = 0 if group is None else dist.get_rank(group)
    start = rank * width
    n_valid = max(0, min(width, vocab - start))
    z = logits if temperature == 1.0 else logits / temperature
    return _VocabParallelLogprobEntropy.apply(z, labels, start, n_valid, group, with_entropy)


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
