"""Sample filters and reward shaping of the DAPO recipe (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv:2503.14476). Pure functions on tensors; the loop
applies them between scoring and building the TrainBatch.
"""
from __future__ import annotations

import torch

from megaforge.algorithms.core import group_index


def nonzero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling's keep mask [B] (bool): True for the samples of groups whose rewards are not
    all equal. A group whose samples all got the same reward has zero advantage under every group
    baseline, so it carries no policy gradient (DAPO, section 3.2). A group of one sample is dropped."""
    idx, g = group_index(group_ids)
    r = rewards.to(torch.float64)
    hi = torch.full((g,), float("-inf"), dtype=torch.float64).scatter_reduce(0, idx, r, "amax")
    lo = torch.full((g,), float("inf"), dtype=torch.float64).scatter_reduce(0, idx, r, "amin")
    return (hi > lo)[idx]


def zero_variance_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of the groups in ``group_ids`` [B] whose rewards [B] are all equal (a group of one
    sample included): ``#{g : max_g(r) == min_g(r)} / #groups``. Under a group baseline (grpo, dr_grpo,
    rloo, reinforce_pp_baseline) such a group's advantages are 0: at 1.0 the step has no policy
    gradient. 0.0 for an empty batch."""
    if rewards.numel() == 0:
        return 0.0
    idx, g = group_index(group_ids)
    kept = torch.zeros(g, dtype=torch.bool).scatter(0, idx, nonzero_variance_groups(rewards, group_ids))
    return float(1.0 - kept.double().mean())


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (section 3.4), added to each response's reward [B]:

        R_len(y) = 0                                   |y| <= L_max - L_cache
                 = penalty * ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                 = -penalty                            |y| > L_max

    with L_max = ``max_len`` (rollout.max_new_tokens), L_cache = ``buffer`` (algo.overlong_buffer).
    ``buffer`` 0 returns zeros.
    """
    lengths = lengths.to(torch.float32)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} exceeds the maximum length {max_len}")
    start = float(max_len - buffer)
    pen = penalty * (start - lengths) / buffer
    pen = torch.where(lengths <= start, torch.zeros_like(pen), pen)
    return torch.where(lengths > max_len, torch.full_like(pen, -penalty), pen)


def first_groups(group_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Keep mask [B] of the samples of the first ``n`` distinct groups, in order of appearance."""
    seen: dict[int, int] = {}
    keep = torch.zeros(group_ids.shape[0], dtype=torch.bool)
    for i, g in enumerate(group_ids.tolist()):
        if g not in seen and len(seen) < n:
            seen[g] = 1
        keep[i] = g in seen
    return keep
