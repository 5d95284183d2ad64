"""Config sections of the RL objective (``grpo:``, ``algo:``, ``critic:``) and the typed parameters
that algorithm registry entries declare (read at config build, imported then: see algo_components).
The keys the objective reads are declared in :mod:`megaforge.config.objective`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megaforge import configtree
from megaforge.config.objective import GROUP_BASELINE_ADVANTAGES, AlgoKeys, GRPOConfig  # noqa: F401  (re-exported)
from megaforge.configtree import ConfigError, bounded


@dataclass
class AlgoConfig(AlgoKeys):
    """Which estimator, loss and aggregation; see ``megaforge.algorithms`` for formulas."""

    components: dict = field(default_factory=lambda: {p: c() for p, c in algo_components({}).items()},
                             metadata={"extensions": lambda data: algo_components(data)})
    """(Not a key.) The typed parameters that registry entries declare (``register("sapo",
    params=SapoParams)``), by key prefix: field ``tau_pos`` is key ``algo.sapo_tau_pos``
    (megaforge.algorithms.params). Built-in: sapo_tau_pos, sapo_tau_neg, cispo_clip_low, reinforce_clip."""


def algo_components(data: dict) -> dict[str, type]:
    """{key prefix: parameters dataclass} of the registered algorithm components, the extension keys of
    the ``algo`` section (megaforge.configtree): megaforge's and those of the modules of ``algo.plugins``
    in ``data``, which are imported first."""
    # lazy: imported when a config is built, not with this module: the algorithms import torch, and
    # reward worker processes import megaforge.config (RewardSpec) within a reward's start-up deadline
    from megaforge.algorithms.params import component_classes, load_plugins

    plugins = configtree.coerce(data.get("plugins", []), list[str], "algo.plugins")
    load_plugins(plugins)
    classes = component_classes(plugins)
    own = {f.name for f in dataclasses.fields(AlgoConfig)}
    for prefix, c in classes.items():
        for f in dataclasses.fields(c):
            if prefix + f.name in own:
                raise ConfigError(f"config key 'algo.{prefix}{f.name}' is AlgoConfig's own and also a field of "
                                  f"{c.__name__}: rename the field or the registry entry")
    return classes


@dataclass
class CriticConfig:
    """The value model of PPO (``algo.advantage: gae``): the policy's backbone plus a linear value head,
    trained with the clipped value loss through the trainer backend."""

    enabled: Optional[bool] = None
    """Train a critic; null: exactly when algo.advantage is gae."""
    path: str = ""
    """Hugging Face model directory of the critic's backbone; empty: a copy of the policy at RL start
    (after the SFT warm start; the only choice of trainer.backend megatron, where the critic is a
    second GPTModel at the policy's layout). The value head starts at zero."""
    lr: float = bounded(1e-5, gt=0)
    """Critic learning rate (constant, AdamW with the trainer's betas / eps / weight decay)."""
    value_clip: Optional[float] = bounded(0.2, gt=0)
    """PPO value clipping: V_clip = V_old + clip(V - V_old, -value_clip, value_clip); null disables."""
