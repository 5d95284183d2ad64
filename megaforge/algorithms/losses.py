"""Policy losses. Each: ``fn(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams)
-> (per_token_loss [B, T], stats)`` where ``stats`` maps a metric name to a per-token tensor [B, T]
(e.g. a 0/1 "clipped" indicator) that the objective averages over trained tokens.

``logprobs`` carries the gradient; ``old_logprobs`` (pi_old, the policy that the ratio is taken
against) and ``advantages`` are constants.

A loss whose paper fixes how the per-token terms are averaged declares it in its registry entry
(``loss_agg=...``): ``algo.loss_agg: null`` then selects it, and a different explicit value is a
config error (:func:`megaforge.algorithms.params.resolve_loss_agg`). gspo and sapo declare
``seq_mean_token_mean``, the mean over the group's sequences of each sequence's token mean.

A loss with knobs of its own declares them (``params=SapoParams``): field ``tau_pos`` of entry
``sapo`` is config key ``algo.sapo_tau_pos``, read with ``p.of(SapoParams)``
(:mod:`megaforge.algorithms.params`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megaforge.algorithms.core import POLICY_LOSSES
from megaforge.algorithms.params import ObjectiveParams
from megaforge.configtree import FieldError


@dataclass(frozen=True)
class CispoParams:
    clip_low: Optional[float] = None
    """CISPO weight lower bound is 1 - cispo_clip_low (null: no lower bound, as in the paper); the
    upper bound is 1 + grpo.clip_high."""

    def validate(self) -> None:
        if self.clip_low is not None and not 0 <= self.clip_low <= 1:
            raise FieldError("clip_low", "must be in [0, 1] (or null)")


@dataclass(frozen=True)
class SapoParams:
    tau_pos: float = 1.0
    """SAPO gate temperature for positive-advantage tokens (paper default 1.0)."""
    tau_neg: float = 1.05
    """SAPO gate temperature for negative-advantage tokens (paper default 1.05)."""

    def validate(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            if getattr(self, name) <= 0:
                raise FieldError(name, "must be > 0")


@dataclass(frozen=True)
class ReinforceParams:
    clip: Optional[float] = None
    """``reinforce`` loss: clip the detached ratio pi/pi_old to [1 - c, 1 + c] (null: no clipping)."""

    def validate(self) -> None:
        if self.clip is not None and not 0 <= self.clip < 1:
            raise FieldError("clip", "must be in [0, 1) (or null)")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
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


def _seq_log_ratio(logprobs, old_logprobs, mask):
    """Per-row mean token log-ratio over trained tokens, [B] (0 for rows without trained tokens)."""
    lr = (logprobs - old_logprobs) * mask
    return lr.sum(-1) / mask.sum(-1).clamp_min(1.0)


@POLICY_LOSSES.register("gspo", loss_agg="seq_mean_token_mean")
def gspo_loss(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071).

    Sequence-level ratio, the geometric mean of the token ratios of response i:
        s_i = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp(mean_t (logp_t - logp_old_t))
    in the paper's GSPO-token form, whose value is s_i at every token and whose gradient flows
    through each token's own log-prob:
        s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]
        L_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_low, 1 + clip_high))
    With a sequence-level advantage (A_it = A_i) the clipping decision is per sequence and the
    gradient of the sequence's mean loss is -A_i s_i (1/|y_i|) sum_t grad logp_it (the paper's
    gradient) when s_i is inside the band, 0 outside. The paper's objective is the mean over the
    group's sequences, J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i): this entry declares
    ``loss_agg: seq_mean_token_mean`` (the token form's sequence mean is the sequence term). The
    paper uses a much narrower band (clip_low 3e-4, clip_high 4e-4).
    """
    seq_log_ratio = _seq_log_ratio(logprobs, old_logprobs, mask).clamp(-20.0, 20.0)
    s_seq = torch.exp(seq_log_ratio).detach()  # [B]
    s = s_seq[:, None] * torch.exp(logprobs - logprobs.detach())
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": (clipped > unclipped).float(), "seq_ratio": s.detach()}
    return loss, stats


@POLICY_LOSSES.register("cispo", params=CispoParams)
def cispo_loss(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv:2506.13585).

    The importance-sampling weight is clipped and detached; the token's log-prob keeps its
    gradient whatever the ratio, so no token is dropped from the update:
        r_t  = pi(y_t) / pi_old(y_t)
        w_t  = clip(r_t, 1 - cispo_clip_low, 1 + clip_high)   (no lower bound when cispo_clip_low is null)
        L_t  = -sg[w_t] * A_t * logp_t        grad L_t = -w_t A_t grad logp_t
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0)).detach()
    clip_low = p.of(CispoParams).clip_low
    lo = 0.0 if clip_low is None else 1.0 - clip_low
    hi = 1.0 + p.clip_high
    w = ratio.clamp(lo, hi)
    loss = -w * advantages * logprobs
    return loss, {"clip_frac": ((ratio > hi) | (ratio < lo)).float(), "ratio": ratio}


@POLICY_LOSSES.register("sapo", loss_agg="seq_mean_token_mean", params=SapoParams)
def sapo_loss(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """SAPO (Gao et al. 2025, Qwen team, "Soft Adaptive Policy Optimization", arXiv:2511.20347).

    Hard clipping is replaced by a smooth, temperature-controlled gate of the token ratio:
        r_t = pi(y_t) / pi_old(y_t)
        f(r) = sigma(tau (r - 1)) * 4 / tau,   tau = sapo_tau_pos if A_t > 0 else sapo_tau_neg
        L_t = -f(r_t) * A_t
    so grad L_t = -w_t r_t A_t grad logp_t with the gate weight w_t = 4 sigma(tau (r_t - 1))
    (1 - sigma(tau (r_t - 1))): 1 on-policy (r = 1, the plain policy gradient), decaying smoothly
    as r leaves 1, faster for larger tau. The paper uses tau_neg > tau_pos (1.05 vs 1.0) because
    negative-advantage updates spread to many unsampled tokens. Its objective averages the gated
    terms per sequence, then over the group: J = (1/G) sum_i (1/|y_i|) sum_t f(r_it) A_it, so this
    entry declares ``loss_agg: seq_mean_token_mean``.
    """
    q = p.of(SapoParams)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, torch.full_like(ratio, q.tau_pos), torch.full_like(ratio, q.tau_neg))
    sig = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(sig * 4.0 / tau) * advantages
    gate = (4.0 * sig * (1.0 - sig)).detach()
    return loss, {"sapo_gate": gate, "ratio": ratio.detach()}


@POLICY_LOSSES.register("reinforce", params=ReinforceParams)
def reinforce_loss(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """REINFORCE (Williams 1992) with an optional clipped, detached importance ratio (as
    torchforge ``ReinforceLoss(clip_ratio=c)``).

        w_t = sg[r_t],  r_t = pi(y_t) / pi_old(y_t)  (1 on-policy), clipped to [1 - c, 1 + c] when
        ``algo.reinforce_clip`` = c
        L_t = -w_t * A_t * logp_t

    Unlike PPO's ratio clipping, tokens outside the band keep their gradient (scaled by the
    clipped weight). With a clip this is CISPO with a symmetric band.
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0)).detach()
    stats = {"ratio": ratio}
    w = ratio
    clip = p.of(ReinforceParams).clip
    if clip is not None:
        lo, hi = 1.0 - clip, 1.0 + clip
        w = ratio.clamp(lo, hi)
        stats["clip_frac"] = ((ratio > hi) | (ratio < lo)).float()
    return -w * advantages * logprobs, stats
