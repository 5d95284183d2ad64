"""KL estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence",
2020). Each: ``fn(logprobs, ref_logprobs) -> per-token estimate [B, T]``, with
``log_r = logp - logp_ref``.
"""
from __future__ import annotations

import torch

from megaforge.algorithms.core import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs, ref_logprobs):
    """k1 = log_r (unbiased, high variance, can be negative)."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs, ref_logprobs):
    """k2 = 0.5 * log_r^2 (biased, low variance, >= 0)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs, ref_logprobs):
    """k3 = exp(-log_r) - 1 + log_r (unbiased, >= 0); GRPO's estimator."""
    log_r = logprobs - ref_logprobs
    return torch.exp(-log_r) - 1.0 + log_r


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(logprobs, ref_logprobs):
    """k3 with log_r clamped to [-20, 20] and the result clamped to [-10, 10] (numerically safe)."""
    log_r = (logprobs - ref_logprobs).clamp(-20.0, 20.0)
    return (torch.exp(-log_r) - 1.0 + log_r).clamp(-10.0, 10.0)


def kl_reward_penalty(old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, beta: float,
                      estimator: str) -> torch.Tensor:
    """Per-token reward terms of ``algo.kl_in_reward``, [B, T] (no gradient):

        r_t = -beta * KL_est(logp_old_t, logp_ref_t) * mask_t

    ``old_logprobs`` are the *trainer's* log-probs of the sampled tokens under the current policy
    (pi_old, computed before the update), as verl's ``apply_kl_penalty`` uses the actor's
    ``old_log_probs``: the reference log-probs come from the same trainer forward, so the penalty
    measures the policy's drift from the reference and not the engine's kernel / precision mismatch,
    which the rollout's own log-probs would add (``train_rollout_logprob_abs_diff`` measures that).
    """
    kl = KL_ESTIMATORS.get(estimator)(old_logprobs.detach(), ref_logprobs.detach())
    return -beta * kl * mask
