"""The critic's objective (PPO with a learned value function).

    V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
    L_t    = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)       (0.5 * (V_t - R_t)^2 without clipping)
    loss   = token_mean over the global batch's trained tokens

``R`` are the lambda-returns of :func:`megaforge.algorithms.advantages.gae`, ``V_old`` the values
the advantages were computed with. Value clipping as in OpenAI baselines' PPO2 (Schulman et al.
2017, arXiv:1707.06347; Dhariwal et al. 2017); token-mean as in the other PPO-for-LLM trainers.
"""
from __future__ import annotations

from typing import Optional

import torch

from megaforge.algorithms.stats import contribution, token_mean

def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, value_clip: Optional[float]) -> tuple[torch.Tensor, dict]:
    """Per-token value loss [B, T] and per-token stats (``vf_clip_frac``, ``value_error``)."""
    err = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * err, {"value_error": err.detach(), "vf_clip_frac": torch.zeros_like(err)}
    v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
    err_clip = (v_clip - returns) ** 2
    loss = 0.5 * torch.maximum(err, err_clip)
    return loss, {"value_error": err.detach(), "vf_clip_frac": (err_clip > err).float()}


def value_objective(values, old_values, returns, mask, num_tokens: int, value_clip: Optional[float]):
    """(scalar loss contribution, {metric: Stat}) of one micro-batch: every metric a ``sum``
    contribution, sum_{i,t} x_it m_it / num_tokens (the global trained-token count), so micro-batches
    and ranks add up to the batch's token mean."""
    if num_tokens <= 0:
        raise ValueError("value_objective: num_tokens must be the global trained-token count")
    mask = mask.to(values.dtype)
    per_tok, stats = clipped_value_loss(values, old_values.to(values.dtype), returns.to(values.dtype), mask, value_clip)
    loss = (per_tok * mask).sum() / num_tokens
    metrics = {"critic/loss": contribution(loss),
               "critic/values": token_mean(values, mask, num_tokens),
               "critic/returns": token_mean(returns.to(values.dtype), mask, num_tokens)}
    for k, v in stats.items():
        metrics["critic/" + k] = token_mean(v, mask, num_tokens)
    return loss, metrics
