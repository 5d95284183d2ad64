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
