"""Shared pieces of the RL math: registries, masked reductions, the parameters every loss reads.

Shapes: ``B`` sequences (rows), ``T`` tokens (token-aligned, see :mod:`megaforge.types`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from megaforge.configtree import ConfigError
from megaforge.registry import Registry

ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")


@dataclass(frozen=True)
class LossParams:
    """Everything a policy loss, KL term or aggregation reads (built from the config)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: Optional[float] = None
    beta: float = 0.0
    kl_estimator: str = "low_var_kl"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    loss: str = "ppo_clip"
    loss_agg: str = "token_mean"
    loss_agg_norm: float = 0.0
    tis_cap: Optional[float] = None
    tis_level: str = "token"
    mis_threshold: Optional[float] = None
    mis_threshold_low: Optional[float] = None
    mis_level: str = "token"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cispo_clip_low: Optional[float] = None
    reinforce_clip: Optional[float] = None
    plugin_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg) -> "LossParams":
        """Read the config; imports ``algo.plugins`` and checks that every named component exists,
        so a typo fails at start-up with the config key and the registered names."""
        a, g = cfg.algo, cfg.grpo
        resolve_components(cfg)
        return cls(
            clip_low=g.clip_low, clip_high=g.clip_high, clip_c=a.clip_c, beta=g.beta,
            kl_estimator=a.kl_estimator, kl_in_reward=a.kl_in_reward, entropy_coef=a.entropy_coef,
            loss=a.loss, loss_agg=resolve_loss_agg(a),
            loss_agg_norm=a.loss_agg_norm or float(cfg.rollout.max_new_tokens),
            tis_cap=a.tis_cap, tis_level=a.tis_level, mis_threshold=a.mis_threshold,
            mis_threshold_low=a.mis_threshold_low, mis_level=a.mis_level,
            sapo_tau_pos=a.sapo_tau_pos, sapo_tau_neg=a.sapo_tau_neg, cispo_clip_low=a.cispo_clip_low,
            reinforce_clip=a.reinforce_clip, plugin_kwargs=dict(a.plugin_kwargs),
        )


def load_plugins(modules) -> None:
    """Import each module of ``algo.plugins`` (their import registers losses, advantages, rewards)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"config key 'algo.plugins': cannot import module {name!r}: {e}") from e


def resolve_components(cfg) -> None:
    """Import ``algo.plugins``, then look up every configured algorithm component; an unknown name
    raises ConfigError (a ValueError) naming the config key and listing the registered names."""
    a = cfg.algo
    load_plugins(a.plugins)
    for key, reg in (("algo.advantage", ADVANTAGES), ("algo.loss", POLICY_LOSSES),
                     ("algo.loss_agg", LOSS_AGGS), ("algo.kl_estimator", KL_ESTIMATORS)):
        name = getattr(a, key.split(".")[1])
        if name is None:  # algo.loss_agg null: the loss's own (resolve_loss_agg)
            continue
        try:
            reg.get(name)
        except ValueError as e:
            raise ConfigError(f"config key '{key}': {e}") from e
    resolve_loss_agg(a)


DEFAULT_LOSS_AGG = "token_mean"


def resolve_loss_agg(algo) -> str:
    """The aggregation of ``algo.loss``: ``algo.loss_agg`` when set, else the one the loss's registry
    entry declares (its paper's objective), else token_mean. An explicit ``algo.loss_agg`` that
    contradicts the declared one raises ConfigError naming both keys: under another aggregation the
    loss is not its paper's objective (register the function under another name to run a variant)."""
    declared = POLICY_LOSSES.declared(algo.loss).get("loss_agg")
    if algo.loss_agg is None:
        return declared or DEFAULT_LOSS_AGG
    if declared is not None and algo.loss_agg != declared:
        raise ConfigError(f"config key 'algo.loss_agg': {algo.loss_agg!r} contradicts algo.loss {algo.loss!r}, "
                          f"whose paper's objective aggregates {declared!r}; set algo.loss_agg to {declared!r} "
                          f"or null (the loss's own)")
    return algo.loss_agg


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read.

    rewards [B] sequence rewards; group_ids [B] (samples of one prompt share an id);
    loss_mask [B, T]; token_rewards [B, T] optional per-token reward terms (e.g. -beta * KL when
    the KL is applied in the reward); values [B, T] optional critic values (gae).
    """

    rewards: torch.Tensor
    group_ids: torch.Tensor
    loss_mask: torch.Tensor
    token_rewards: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


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
