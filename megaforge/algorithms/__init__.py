"""Pure tensor math of RL post-training: advantages, policy losses, KL, aggregation, corrections.

A new algorithm is a function plus a registry entry::

    from megaforge.algorithms import POLICY_LOSSES

    @POLICY_LOSSES.register("my_loss")
    def my_loss(logprobs, old_logprobs, advantages, mask, p): ...

or ``algo.loss: my_pkg.losses:my_loss`` in the config. The loop never changes for it.
"""
from megaforge.algorithms.core import (  # noqa: F401
    ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES, AdvantageInputs, LossParams,
    group_stats, masked_mean,
)
from megaforge.algorithms import advantages, aggregation, kl, losses  # noqa: F401  (registration)
from megaforge.algorithms.aggregation import aggregate  # noqa: F401
from megaforge.algorithms.objective import policy_objective, mismatch_weights  # noqa: F401
