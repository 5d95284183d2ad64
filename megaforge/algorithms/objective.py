"""The RL objective of one micro-batch, shared by every trainer backend.

    loss = agg( w_t * L_pg(t) + beta * KL_t - entropy_coef * H_t )

* ``L_pg`` is the configured policy loss (``algo.loss``), ``w_t`` the train/inference mismatch
  correction (truncated or masked importance sampling of pi_old / pi_rollout, 1 when off),
* ``KL_t`` the configured estimator against the frozen reference (skipped when ``beta == 0`` or
  the KL is applied in the reward), ``H_t`` the policy's entropy at token t,
* ``agg`` the configured aggregation over the *global* batch (see :mod:`aggregation`).

Metrics come back as values, :class:`~megaforge.algorithms.stats.Stat` s declaring their reduction:
each is a *contribution* (``sum``) already divided by the global token count (``pg_loss`` and
``loss``: by the aggregation's own global denominator), so the trainer sums them over micro-batches
and data-parallel ranks to get the batch value.
"""
from __future__ import annotations

from typing import Optional

import torch

from megaforge.algorithms.aggregation import aggregate
from megaforge.algorithms.core import KL_ESTIMATORS, POLICY_LOSSES
from megaforge.algorithms.params import ObjectiveParams
from megaforge.algorithms.stats import Stat, contribution, token_mean
from megaforge.types import TrainBatch


def _level_log_ratio(log_r: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log of the ratio at ``level``, broadcast to [B, T]: the token's own (token), the sum over the
    row's trained tokens (sequence: log of the product of ratios), or their mean (geometric)."""
    if level == "token":
        return log_r
    total = (log_r * mask).sum(-1, keepdim=True)
    if level == "sequence":
        return total.clamp(-20.0, 20.0).expand_as(log_r)
    if level == "geometric":
        return (total / mask.sum(-1, keepdim=True).clamp_min(1.0)).expand_as(log_r)
    raise ValueError(f"unknown importance-sampling level {level!r}; valid: token, sequence, geometric")


def mismatch_weights(old_logprobs, rollout_logprobs, mask, p: ObjectiveParams) -> tuple[torch.Tensor, dict]:
    """Importance weights correcting the trainer/engine mismatch, [B, T] (no gradient).

    With rho = pi_old / pi_rollout taken at a *level* (token: rho_t; sequence: prod_t rho_t over the
    row's trained tokens; geometric: exp(mean_t log rho_t)):

    * TIS (truncated IS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
      Off-Policy RL Training"):  w = min(rho_tis_level, tis_cap).
    * MIS (masked IS; IcePop, Ling team 2025, and Liu, Li et al. 2025, "When Speed Kills
      Stability"):  w = rho_mis_level * 1[lo <= rho_mis_level <= mis_threshold]; the ratio is
      rejected (weight 0) outside the band instead of truncated. ``geometric`` is rejection only
      (weight 1 inside the band). With ``tis_cap`` set too, the weight is the TIS weight times the
      MIS indicator.

    Rejected tokens stay in the aggregation's denominator (the estimator's zero contributions), so a
    batch's loss scale does not depend on how many were rejected.
    """
    w = torch.ones_like(old_logprobs)
    stats = {}
    if p.tis_cap is None and p.mis_threshold is None:
        return w, stats
    log_r = (old_logprobs - rollout_logprobs).clamp(-20.0, 20.0) * mask
    if p.tis_cap is not None:
        r = torch.exp(_level_log_ratio(log_r, mask, p.tis_level))
        w = torch.clamp(r, max=p.tis_cap)
        stats["tis_clip_frac"] = (r > p.tis_cap).float()
    if p.mis_threshold is not None:
        r = torch.exp(_level_log_ratio(log_r, mask, p.mis_level))
        keep = r <= p.mis_threshold
        if p.mis_threshold_low is not None:
            keep = keep & (r >= p.mis_threshold_low)
        keep = keep.float()
        if p.tis_cap is None and p.mis_level != "geometric":
            w = r
        w = w * keep
        stats["mis_masked_frac"] = 1.0 - keep
    return w.detach(), stats


def policy_objective(
    logprobs: torch.Tensor,
    mb: TrainBatch,
    p: ObjectiveParams,
    entropy: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Loss of micro-batch ``mb`` given the policy's token-aligned ``logprobs`` [B, T] (with grad).

    ``entropy`` [B, T] is needed when ``entropy_coef != 0`` (with grad) and is logged when given.
    Returns (scalar loss contribution, {metric: Stat}): every metric a ``sum`` contribution, the
    per-token ones (kl, entropy, the loss's and the mismatch correction's stats [B, T]) as
    :func:`~megaforge.algorithms.stats.token_mean` sum_{i,t} x_it m_it / num_tokens.
    """
    mask = mb.loss_mask.to(logprobs.dtype)
    n_tok, n_seq = mb.num_tokens, mb.num_seqs
    if n_tok <= 0:
        raise ValueError("TrainBatch.num_tokens must be set to the global trained-token count")
    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
    loss_fn = POLICY_LOSSES.get(p.loss)
    pg, stats = loss_fn(logprobs, old, mb.advantages.to(logprobs.dtype), mask, p)
    w, wstats = mismatch_weights(old, mb.rollout_logprobs.to(logprobs.dtype), mask, p)
    stats.update(wstats)
    per_token = pg * w
    metrics: dict[str, Stat] = {}

    def contrib(x):  # token-mean contribution of a per-token quantity
        return token_mean(x, mask, n_tok)

    metrics["pg_loss"] = contribution(aggregate(pg.detach() * w, mask, p.loss_agg, n_tok, n_seq, p.loss_agg_norm))
    if mb.ref_logprobs is not None:
        kl = KL_ESTIMATORS.get(p.kl_estimator)(logprobs, mb.ref_logprobs.to(logprobs.dtype))
        metrics["kl"] = contrib(kl)
        if p.beta > 0 and not p.kl_in_reward:
            per_token = per_token + p.beta * kl
    if entropy is not None:
        metrics["entropy"] = contrib(entropy)
        if p.entropy_coef != 0.0:
            per_token = per_token - p.entropy_coef * entropy
    elif p.entropy_coef != 0.0:
        raise ValueError("entropy_coef != 0 needs the policy entropy from the trainer")
    loss = aggregate(per_token, mask, p.loss_agg, n_tok, n_seq, p.loss_agg_norm)
    metrics["loss"] = contribution(loss)
    metrics["train_rollout_logprob_abs_diff"] = contrib((old - mb.rollout_logprobs.to(old.dtype)).abs())
    for k, v in stats.items():
        metrics[k] = contrib(v)
    if "clip_frac" not in metrics:  # a required metric; losses without hard clipping (sapo) clip nothing
        metrics["clip_frac"] = contribution(torch.zeros((), dtype=loss.dtype, device=loss.device))
    return loss, metrics
