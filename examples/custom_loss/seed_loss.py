"""torchforge's Workflow 2 ("Custom Loss Function", torchforge's ``CustomLoss``) as a megaforge plug-in:
a loss with a knob of its own, in this one file.

torchforge's loss is an ``nn.Module`` that computes everything itself: ratio, clipped policy
gradient, a KL penalty, masking and the mean over tokens. In megaforge a policy loss is only the
per-token policy-gradient term; the framework adds the rest from the config, identically for every
loss and both trainer backends:

    seed                                   megaforge
    ratio = exp(logprobs - ref_logprobs)   ratio = exp(logprobs - old_logprobs)  (pi_old, the policy
                                           that sampled; the reference is only for the KL term)
    -min(ratio * A, clip(ratio) * A)       this function's per-token return value
    CustomLoss(clip_range=0.2)             algo.seed_custom_clip_range: 0.2 (SeedCustomParams below)
    beta * kl                              grpo.beta + algo.kl_estimator (k1 = logp - logp_ref)
    (... * padding_mask).sum() / mask.sum  algo.loss_agg: token_mean (over the whole global batch,
                                           so micro-batches and GPUs add up exactly)

Note torchforge's ``kl = ref_logprobs - logprobs`` has the sign flipped: minimising ``beta * kl``
would *reward* moving away from the reference. megaforge's ``k1`` is ``logprobs - ref_logprobs``.

Use it by name (this module registers ``seed_custom`` when imported through ``algo.plugins``)::

    algo: {plugins: [examples.custom_loss.seed_loss], loss: seed_custom, seed_custom_clip_range: 0.2}

(examples/custom_loss/seed_loss.yaml). The registry entry declares ``params=SeedCustomParams``, so
its field ``clip_range`` is config key ``algo.seed_custom_clip_range``: type-checked, validated by
``SeedCustomParams.validate``, listed by ``--help`` and suggested on a typo like every other key.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaforge.algorithms import POLICY_LOSSES, ObjectiveParams
from megaforge.configtree import FieldError


@dataclass(frozen=True)
class SeedCustomParams:
    clip_range: float = 0.2
    """Symmetric ratio clip c of torchforge's CustomLoss: the ratio is clipped to [1 - c, 1 + c]."""

    def validate(self) -> None:
        if not 0 < self.clip_range < 1:
            raise FieldError("clip_range", f"must be in (0, 1), got {self.clip_range}")


@POLICY_LOSSES.register("seed_custom", params=SeedCustomParams)
def custom_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, p: ObjectiveParams):
    """Symmetric clipped policy gradient of torchforge's CustomLoss.

        r_t = exp(logp_t - logp_old_t)
        L_t = -min(r_t A_t, clip(r_t, 1 - c, 1 + c) A_t),   c = algo.seed_custom_clip_range (0.2)

    Returns (per-token loss [B, T], per-token stats); ``mask`` is applied by the aggregation.
    """
    c = p.of(SeedCustomParams).clip_range
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))
    clipped = torch.clamp(ratio, 1.0 - c, 1.0 + c)
    pg_loss = -torch.min(ratio * advantages, clipped * advantages)
    stats = {"clip_frac": (clipped * advantages < ratio * advantages).float(), "ratio": ratio.detach()}
    return pg_loss, stats
