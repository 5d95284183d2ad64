"""Shared pieces of the RL math: registries, masked reductions, group statistics.

Shapes: ``B`` sequences (rows), ``T`` tokens (token-aligned, see :mod:`megaforge.types`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megaforge.registry import Registry

ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")


#: reduces a small float64 tensor elementwise over every share of a batch (see :class:`Share`)
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Share:
    """How an estimator that holds one data-parallel share of a batch reaches the whole batch.

    rows [n] int64: the whole batch's rows the share holds, in the order of its per-token tensors.
    sum / max: a small float64 tensor -> its elementwise sum / maximum over every share of the batch,
    each share counted once. Collective: every share's estimator makes the same calls in the same
    order (the calls depend only on the estimator and on the whole batch's rewards and group ids).
    """

    rows: torch.Tensor
    sum: Reduce
    max: Reduce


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read.

    rewards [B] sequence rewards and group_ids [B] (samples of one prompt share an id) of the whole
    batch; loss_mask [n, T] of the rows held; token_rewards [n, T] optional per-token reward terms
    (e.g. -beta * KL when the KL is applied in the reward); values [n, T] optional critic values (gae);
    logprobs [n, T] optional log-probs of the sampled tokens under the sampling policy (the trainer's
    pi_old) and teacher_logprobs [n, T] under the distillation teacher (distill), 0 where loss_mask is 0.
    ``share`` None: the whole batch is held (n = B, rows in order). Otherwise the rows held are
    ``share.rows`` (:meth:`held` picks them from a [B] tensor), and a batch-wide statistic of per-token
    data adds up the shares' partials with :meth:`batch_sum` / :meth:`batch_max` (an estimator that
    reduces over the batch by itself computes its share's statistic, not the batch's).
    """

    rewards: torch.Tensor
    group_ids: torch.Tensor
    loss_mask: torch.Tensor
    token_rewards: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    share: Optional[Share] = None
    logprobs: Optional[torch.Tensor] = None
    teacher_logprobs: Optional[torch.Tensor] = None

    def __post_init__(self):
        b, n = self.rewards.shape[0], self.loss_mask.shape[0]
        if tuple(self.group_ids.shape) != (b,) or self.rewards.dim() != 1:
            raise ValueError(f"AdvantageInputs: rewards {tuple(self.rewards.shape)} and group_ids "
                             f"{tuple(self.group_ids.shape)} must both be [B]")
        held = (b,) if self.share is None else tuple(self.share.rows.shape)
        if held != (n,):
            where = f"B = {b}" if self.share is None else f"share.rows {held}"
            raise ValueError(f"AdvantageInputs: loss_mask has {n} rows, the rows held are {where}")
        for name in ("token_rewards", "values", "logprobs", "teacher_logprobs"):
            t = getattr(self, name)
            if t is not None and t.shape != self.loss_mask.shape:
                raise ValueError(f"AdvantageInputs.{name}: shape {tuple(t.shape)}, loss_mask "
                                 f"{tuple(self.loss_mask.shape)}")

    def held(self, x: torch.Tensor) -> torch.Tensor:
        """The rows held of a whole-batch tensor ``x`` [B, ...] -> [n, ...]."""
        return x if self.share is None else x[self.share.rows]

    def batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (float64, a few elements) summed elementwise over the batch's shares."""
        return t if self.share is None else self.share.sum(t)

    def batch_max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``t`` (float64, a few elements) over the batch's shares."""
        return t if self.share is None else self.share.max(t)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """sum(x * mask) / sum(mask) (0 when the mask is empty)."""
    denom = mask.sum()
    return (x * mask).sum() / denom.clamp_min(1.0) if eps == 0.0 else (x * mask).sum() / (denom + eps)


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids [B] to dense 0..G-1 indices [B]; returns (index, G)."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(uniq.numel())


def group_moments(values: torch.Tensor, group_ids: torch.Tensor):
    """Per-row (mean, unbiased std, size, all_equal) of the row's group, float64 [B] (all_equal: bool).

    Computed in float64 from the given values: for float32 inputs the centred values ``v - mean`` are
    exact, and a group of equal values has mean equal to that value. ``all_equal`` compares the values
    themselves (group min == max), so zero variance is detected by equality and not as ``std > 0``
    after rounding (three float64 rewards of 0.1 have a float64 mean of 0.10000000000000002).
    std uses Bessel's correction (n - 1); groups of one sample get std 0.
    """
    idx, g = group_index(group_ids)
    v = values.to(torch.float64)
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, idx, torch.ones_like(v))
    total = torch.zeros(g, dtype=torch.float64).index_add_(0, idx, v)
    mean = total / count
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, idx, (v - mean[idx]) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp_min(1), torch.zeros_like(sq))
    lo = torch.full((g,), float("inf"), dtype=torch.float64).scatter_reduce(0, idx, v, "amin")
    hi = torch.full((g,), float("-inf"), dtype=torch.float64).scatter_reduce(0, idx, v, "amax")
    return mean[idx], var.sqrt()[idx], count[idx], (lo == hi)[idx]


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased group std and group size, each [B] in the values' float dtype
    (see :func:`group_moments`)."""
    mean, std, count, _ = group_moments(values, group_ids)
    dt = values.dtype if values.is_floating_point() else torch.float32
    return mean.to(dt), std.to(dt), count.to(dt)


def group_centered(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``v - mean_g(v)`` per row [B] (float64 arithmetic, result in the values' float dtype); exactly 0
    for every row of a group whose values are all equal."""
    mean, _, _, equal = group_moments(values, group_ids)
    c = values.to(torch.float64) - mean
    dt = values.dtype if values.is_floating_point() else torch.float32
    return torch.where(equal, torch.zeros_like(c), c).to(dt)
