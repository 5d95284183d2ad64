"""Advantage estimators. Each: ``fn(inputs: AdvantageInputs, p: ObjectiveParams) -> advantages [n, T]``
for the rows held (the whole batch, n = B, or one data-parallel share of it: ``inputs.share``).

Sequence-level estimators (grpo, dr_grpo, rloo) broadcast one value per row over its trained
tokens; token-level ones (reinforce_pp, reinforce_pp_baseline, gae) turn the sequence reward plus
the per-token reward terms (``AdvantageInputs.token_rewards``, the KL penalty when
``algo.kl_in_reward``) into returns. Every result is 0 wherever ``loss_mask`` is 0.

On a share: group statistics come from the whole batch's rewards and group ids (every share has
them, [B]; a group may span shares), per-token work is per row, and the batch-wide whitening
(:func:`whiten`) adds up the shares' partials through ``inputs.batch_sum`` / ``inputs.batch_max``.
"""
from __future__ import annotations

import torch

from megaforge.algorithms.core import ADVANTAGES, AdvantageInputs, Reduce, group_centered, group_moments
from megaforge.algorithms.params import ObjectiveParams


def _broadcast(seq_adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return seq_adv[:, None].to(loss_mask.dtype) * loss_mask


@ADVANTAGES.register("grpo", shares=True)
def grpo_advantage(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), outcome supervision.

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps) for sample i of group g, std with Bessel's
    correction; every response token of sample i gets A_i. Groups of one sample, and groups whose
    rewards are all equal (compared as values, not as a rounded std > 0), get exactly 0, also with
    std_eps 0. Arithmetic in float64 (:func:`~megaforge.algorithms.core.group_moments`).
    """
    mean, std, count, equal = group_moments(inp.rewards, inp.group_ids)
    denom = std + p.std_eps
    adv = (inp.rewards.to(torch.float64) - mean) / torch.where(denom > 0, denom, torch.ones_like(denom))
    adv = torch.where((count > 1) & ~equal & (denom > 0), adv, torch.zeros_like(adv))
    return _broadcast(inp.held(adv), inp.loss_mask)


@ADVANTAGES.register("dr_grpo", shares=True)
def dr_grpo_advantage(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    A_i = r_i - mean_g(r): no std normalisation. Pair it with ``loss_agg: seq_mean_token_sum_norm``
    to also drop the per-sequence length normalisation.
    """
    return _broadcast(inp.held(group_centered(inp.rewards, inp.group_ids)), inp.loss_mask)


@ADVANTAGES.register("rloo", shares=True)
def rloo_advantage(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740): leave-one-out baseline.

    A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j = n / (n - 1) * (r_i - mean_g(r)) for a group of n;
    groups of one sample (and groups of equal rewards) get 0.
    """
    _, _, count, _ = group_moments(inp.rewards, inp.group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.zeros_like(count))
    adv = scale * group_centered(inp.rewards, inp.group_ids).to(torch.float64)
    return _broadcast(inp.held(adv), inp.loss_mask)


# ------------------------------------------------------------------------- token-level estimators
def token_rewards(inp: AdvantageInputs, seq_rewards: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [n, T] of the rows held: ``inp.token_rewards`` (e.g. -beta * KL_t, 0 when
    absent) plus the sequence reward (``seq_rewards`` [B], the whole batch's) on the last trained
    token of each row."""
    seq_rewards = inp.held(seq_rewards)
    mask = inp.loss_mask
    r = torch.zeros_like(mask) if inp.token_rewards is None else inp.token_rewards.to(mask.dtype) * mask
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device)[None, :].expand_as(mask)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(-1).values  # [B], -1: no token
    has = last >= 0
    rows = torch.nonzero(has).squeeze(-1)
    r = r.clone()
    r[rows, last[rows]] += seq_rewards[rows].to(r.dtype)
    return r


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over trained tokens only (untrained positions are skipped, so a
    tool output between two model turns is not a time step); 0 where mask is 0."""
    B, T = rewards.shape
    out = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in range(T - 1, -1, -1):
        m = mask[:, t] > 0
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _trained_max(v: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """max of ``v`` where ``trained`` (a 0-dim float64; -inf when nothing is trained)."""
    return torch.cat([v[trained], torch.tensor([float("-inf")], dtype=v.dtype)]).max()


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float, batch_sum: Reduce = _identity,
           batch_max: Reduce = _identity) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and population std over the trained tokens of the batch
    (mask 0/1), 0 where mask is 0.

    ``x`` / ``mask`` may be one share's rows of the batch: ``batch_sum`` / ``batch_max`` then combine
    the shares' partials (:class:`~megaforge.algorithms.core.Share`; identity: the whole batch), in two
    passes as in one process: count n and sum S -> mean = S / n; then the centred sum of squares Q ->
    var = Q / n. Arithmetic in float64, result in x's dtype: for float32 values the centring is exact
    (the float64 mean of equal float32 values is that value). When every trained value is equal
    (compared as values: the batch's min == max) the result is exactly 0, whatever ``eps`` is.
    """
    x64, m64 = x.to(torch.float64), mask.to(torch.float64)
    trained = mask > 0
    # the batch's -min and max over trained values (-inf, -inf: no trained token anywhere)
    neg_lo, hi = batch_max(torch.stack([_trained_max(-x64, trained), _trained_max(x64, trained)]))
    if bool(hi == float("-inf")) or bool(-neg_lo == hi):
        return torch.zeros_like(x)
    n, total = batch_sum(torch.stack([m64.sum(), (x64 * m64).sum()]))
    mean = total / n
    var = batch_sum((((x64 - mean) * m64) ** 2).sum()) / n
    denom = var.sqrt() + eps
    if float(denom) == 0.0:  # distinct values whose spread underflows float64
        return torch.zeros_like(x)
    return ((x64 - mean) / denom * m64).to(x.dtype)


@ADVANTAGES.register("reinforce_pp", shares=True)
def reinforce_pp_advantage(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models", arXiv:2501.03262).

    Token rewards r_t = -beta * KL_t (``algo.kl_in_reward``; 0 otherwise) + R_i at the last response
    token; returns G_t = sum_{s >= t} gamma^(s - t) r_s; advantages normalised over the whole batch:
        A_t = (G_t - mean_batch(G)) / (std_batch(G) + std_eps)    (mean/std over trained tokens)
    """
    g = discounted_returns(token_rewards(inp, inp.rewards), inp.loss_mask, p.gamma)
    return whiten(g, inp.loss_mask, p.std_eps, inp.batch_sum, inp.batch_max)


@ADVANTAGES.register("reinforce_pp_baseline", shares=True)
def reinforce_pp_baseline_advantage(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, the group-baseline variant): the group mean
    reward is subtracted first, then as ``reinforce_pp``:
        R'_i = R_i - mean_g(R);  r_t = -beta * KL_t + R'_i [t = last];  A = batch-normalised G
    (R'_i is exactly 0 in a group of equal rewards.)
    """
    g = discounted_returns(token_rewards(inp, group_centered(inp.rewards, inp.group_ids)), inp.loss_mask, p.gamma)
    return whiten(g, inp.loss_mask, p.std_eps, inp.batch_sum, inp.batch_max)


def gae(inp: AdvantageInputs, p: ObjectiveParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over trained tokens:

        delta_t = r_t + gamma * V_next - V_t        (V_next = 0 after the last trained token)
        A_t     = delta_t + gamma * lam * A_next
        returns = A_t + V_t                          (the critic's lambda-return targets)

    with r_t from :func:`token_rewards` and V_t = ``inp.values`` (value of the prefix before token t).
    Returns (raw advantages, returns), both 0 where loss_mask is 0.
    """
    if inp.values is None:
        raise ValueError("advantage 'gae' needs critic values (config key critic.enabled: the loop "
                         "computes them when the critic is on)")
    mask = inp.loss_mask
    r = token_rewards(inp, inp.rewards)
    v = inp.values.to(r.dtype) * mask
    B, T = r.shape
    adv = torch.zeros_like(r)
    next_v = torch.zeros(B, dtype=r.dtype, device=r.device)
    next_a = torch.zeros_like(next_v)
    for t in range(T - 1, -1, -1):
        m = mask[:, t] > 0
        delta = r[:, t] + p.gamma * next_v - v[:, t]
        a = delta + p.gamma * p.lam * next_a
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_v = torch.where(m, v[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    return adv, (adv + v) * mask


@ADVANTAGES.register("gae", shares=True)
def gae_advantage(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """PPO's advantages (Schulman et al. 2017, arXiv:1707.06347; as in InstructGPT, Ouyang et al.
    2022): :func:`gae` whitened over the batch's trained tokens, A = (A - mean) / (std + std_eps).
    The critic is trained on the unwhitened :func:`gae` returns with the clipped value loss."""
    adv, _ = gae(inp, p)
    return whiten(adv, inp.loss_mask, p.std_eps, inp.batch_sum, inp.batch_max)


def value_targets(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """The critic's regression targets: the lambda-returns of :func:`gae` [n, T] (per row: no
    batch-wide statistic)."""
    return gae(inp, p)[1]
