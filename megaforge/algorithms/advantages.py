"""Advantage estimators. Each: ``fn(inputs: AdvantageInputs, cfg: AlgoConfig) -> advantages [B, T]``.

Sequence-level estimators broadcast one value per row over its trained tokens (``loss_mask``);
the result is 0 wherever ``loss_mask`` is 0.
"""
from __future__ import annotations

import torch

from megaforge.algorithms.core import ADVANTAGES, AdvantageInputs, group_stats


def _broadcast(seq_adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return seq_adv[:, None].to(loss_mask.dtype) * loss_mask


@ADVANTAGES.register("grpo")
def grpo_advantage(inp: AdvantageInputs, cfg) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), outcome supervision.

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps) for sample i of group g, std with Bessel's
    correction; every response token of sample i gets A_i. Groups of one sample get 0.
    """
    mean, std, count = group_stats(inp.rewards, inp.group_ids)
    adv = (inp.rewards - mean) / (std + cfg.std_eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return _broadcast(adv, inp.loss_mask)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantage(inp: AdvantageInputs, cfg) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    A_i = r_i - mean_g(r): no std normalisation. Pair it with ``loss_agg: seq_mean_token_sum_norm``
    to also drop the per-sequence length normalisation.
    """
    mean, _, _ = group_stats(inp.rewards, inp.group_ids)
    return _broadcast(inp.rewards - mean, inp.loss_mask)


@ADVANTAGES.register("rloo")
def rloo_advantage(inp: AdvantageInputs, cfg) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740): leave-one-out baseline.

    A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j = n / (n - 1) * (r_i - mean_g(r)) for a group of n;
    groups of one sample get 0.
    """
    mean, _, count = group_stats(inp.rewards, inp.group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.zeros_like(count))
    return _broadcast(scale * (inp.rewards - mean), inp.loss_mask)
