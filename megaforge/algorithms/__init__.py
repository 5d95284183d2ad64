"""Pure tensor math of RL post-training: advantages, policy losses, KL, aggregation, corrections.

A new algorithm is a function plus a registry entry::

    from megaforge.algorithms import POLICY_LOSSES

    @POLICY_LOSSES.register("my_loss")
    def my_loss(logprobs, old_logprobs, advantages, mask, p): ...

or ``algo.loss: my_pkg.losses:my_loss`` in the config (or ``algo.plugins: [my_pkg.losses]`` and
``algo.loss: my_loss``). The loop never changes for it. ``p`` is the run's
:class:`~megaforge.algorithms.params.ObjectiveParams`; ``register("my_loss", params=MyParams)``
gives the loss typed knobs of its own, config keys ``algo.my_loss_<field>``. Families: advantages (grpo, dr_grpo, rloo,
reinforce_pp, reinforce_pp_baseline, gae; distill: on-policy distillation's per-token reverse KL to a teacher), policy losses (ppo_clip, gspo, cispo, sapo, reinforce),
aggregations, KL estimators, train/inference mismatch corrections (objective), the critic's value
loss (value) and DAPO's filters and overlong shaping (filters); the parameters they all read (params);
the statistics a loss returns, each declaring its reduction (stats).
An advantage estimator registered with ``shares=True`` also works on one data-parallel share of a batch
(:class:`~megaforge.algorithms.core.AdvantageInputs` ``.share``: what the loop uses when the advantages
read the trainer's per-token results, on several ranks).
"""
from megaforge.algorithms.core import (  # noqa: F401
    ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES, AdvantageInputs, Share, group_stats, masked_mean,
)
from megaforge.algorithms.params import (  # noqa: F401
    ObjectiveParams, component_classes, load_plugins, resolve_components, resolve_loss_agg,
)
from megaforge.algorithms import advantages, aggregation, distill, kl, losses  # noqa: F401  (registration)
from megaforge.algorithms.aggregation import aggregate  # noqa: F401
from megaforge.algorithms.advantages import gae, value_targets  # noqa: F401
from megaforge.algorithms.kl import kl_reward_penalty  # noqa: F401
from megaforge.algorithms.filters import (first_groups, nonzero_variance_groups, overlong_penalty,  # noqa: F401
                                         zero_variance_fraction)
from megaforge.algorithms.objective import policy_objective, mismatch_weights  # noqa: F401
from megaforge.algorithms.stats import Stat, contribution, largest, token_mean  # noqa: F401
from megaforge.algorithms.value import clipped_value_loss, value_objective  # noqa: F401
