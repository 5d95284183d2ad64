"""Policy losses. Each: ``fn(logprobs, old_logprobs, advantages, mask, p: LossParams)
-> (per_token_loss [B, T], stats)`` where ``stats`` maps a metric name to a per-token tensor [B, T]
(e.g. a 0/1 "clipped" indicator) that the objective averages over trained tokens.

``logprobs`` carries the gradient; ``old_logprobs`` (pi_old, the policy that the ratio is taken
against) and ``advantages`` are constants.
"""
from __future__ import annotations

import torch

from megaforge.algorithms.core import POLICY_LOSSES, LossParams


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logprobs, old_logprobs, advantages, mask, p: LossParams):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with clip-higher
    (DAPO, Yu et al. 2025, arXiv:2503.14476) and dual-clip (Ye et al. 2020, arXiv:1912.09729).

    r = exp(logp - logp_old)
    L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    dual-clip (A < 0): L = min(L, -A clip_c)
    """
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).float()
    stats = {"clip_frac": clip_active}
    if p.clip_c is not None:
        dual = -advantages * p.clip_c
        neg = advantages < 0
        dual_active = (neg & (loss > dual)).float()
        loss = torch.where(neg, torch.minimum(loss, dual), loss)
        stats["dual_clip_frac"] = dual_active
    stats["ratio"] = ratio.detach()
    return loss, stats
