"""The config keys that advantages, losses, KL terms and aggregations read, declared once (``grpo:`` and
the ``algo:`` section's own keys; ``teacher:``'s are in :mod:`megaforge.config.teacher`).

:class:`~megaforge.algorithms.params.ObjectiveParams` copies its fields from these dataclasses (name, type,
default, range), so a key is declared here and nowhere else: a new field of :class:`AlgoKeys` is a
config key, listed by ``--help``, and ``p.<name>`` of every estimator and loss. This module imports no
part of ``megaforge.algorithms`` (which imports it); the ``algo:`` section's extension keys, which the
algorithm registries decide, are added by :class:`megaforge.config.algo.AlgoConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megaforge.configtree import bounded


#: estimators whose baseline is the mean of a prompt's group: with one sample per prompt (grpo.n_samples 1)
#: every advantage is 0 and the policy cannot learn
GROUP_BASELINE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


@dataclass
class GRPOConfig:
    """torchforge's ``grpo:`` block: group sampling and the clipped objective's numbers."""

    n_samples: int = 8
    """Responses sampled per prompt (the group size)."""
    clip_low: float = bounded(0.2, ge=0, lt=1)
    """Ratio lower clip: ratio >= 1 - clip_low."""
    clip_high: float = bounded(0.28, ge=0)
    """Ratio upper clip: ratio <= 1 + clip_high (clip-higher when > clip_low)."""
    beta: float = bounded(0.0, ge=0)
    """KL coefficient against the frozen reference policy (0 disables the reference model)."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature; the trainer's logprobs use the same temperature."""


@dataclass
class AlgoKeys:
    """The ``algo:`` section's own keys (:class:`~megaforge.config.algo.AlgoConfig` is this plus the keys
    that algorithm registry entries declare); see ``megaforge.algorithms`` for formulas."""

    advantage: str = "grpo"
    """Advantage estimator: grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae (needs the
    critic) | distill (on-policy distillation: the per-token reverse KL to the ``teacher:`` section's model,
    plus its task_coef x the task reward's advantage) | a name registered by an ``algo.plugins`` module | ``package.module:callable``."""
    loss: str = "ppo_clip"
    """Policy loss: ppo_clip | gspo | cispo | sapo | reinforce | a registered name | ``package.module:callable``."""
    loss_agg: Optional[str] = None
    """Loss aggregation: token_mean | seq_mean_token_sum | seq_mean_token_mean | seq_mean_token_sum_norm |
    null: the loss's own, as its paper (gspo, sapo: seq_mean_token_mean, the mean over sequences of each
    sequence's token mean; the other losses: token_mean). A value contradicting gspo's or sapo's is an
    error (under it the loss is not its paper's objective)."""
    loss_agg_norm: float = bounded(0.0, ge=0)
    """Constant normaliser of seq_mean_token_sum_norm (0: rollout.max_new_tokens)."""
    kl_estimator: str = "low_var_kl"
    """KL estimator: k1 | k2 | k3 | low_var_kl."""
    kl_in_reward: bool = False
    """Apply the KL as a per-token reward penalty instead of a loss term: r_t -= grpo.beta * KL_t, with
    KL_t taken from the trainer's old log-probs (pi_old, computed before the update) against the
    reference, as verl does; not from the engine's rollout log-probs, which a different kernel computes."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= entropy_coef * entropy)."""
    clip_c: Optional[float] = bounded(None, gt=1)
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens; null disables."""
    std_eps: float = bounded(1e-6, ge=0)
    """Epsilon added to the std by ``grpo`` (group std) and the batch-normalised estimators."""
    tis_cap: Optional[float] = bounded(None, gt=0)
    """Truncated importance sampling cap on pi_old/pi_rollout (null disables)."""
    tis_level: Literal["token", "sequence"] = "token"
    """TIS ratio: per token, or the sequence's product of token ratios applied to all its tokens."""
    mis_threshold: Optional[float] = bounded(None, gt=0)
    """Masked importance sampling: weight 0 where pi_old/pi_rollout exceeds this (null disables)."""
    mis_threshold_low: Optional[float] = bounded(None, gt=0)
    """Masked importance sampling lower bound: weight 0 where the ratio is below this (null: none)."""
    mis_level: Literal["token", "sequence", "geometric"] = "token"
    """MIS ratio: per token, the sequence's product of ratios, or its geometric mean (rejection only)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (zero advantage) and sample more prompts to keep
    rollout.batch_size groups; DAPO. Prompts per extra round: missing groups * loop.oversample."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step when dynamic sampling; after the last one the step trains on the
    groups kept so far (all of the last round's groups when none was kept)."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: responses longer than rollout.max_new_tokens - overlong_buffer
    get a linearly growing penalty (0 disables)."""
    overlong_penalty: float = bounded(1.0, ge=0)
    """Penalty at rollout.max_new_tokens tokens (DAPO: 1.0)."""
    gamma: float = bounded(1.0, gt=0, le=1)
    """Discount for reinforce_pp / gae."""
    lam: float = bounded(1.0, ge=0, le=1)
    """GAE lambda."""
    plugins: list[str] = field(default_factory=list)
    """Modules imported at start-up so that the losses / advantages / rewards they register by name
    (``@POLICY_LOSSES.register("my_loss")``) can be used by that name."""
    plugin_kwargs: dict = field(default_factory=dict)
    """Extra untyped values for plug-in losses / advantages (``p.plugin_kwargs``); typed knobs are
    declared by the plug-in's registry entry (``params=``) and set as ``algo.<entry>_<field>``."""
