"""megaforge's configuration tree: one typed dataclass per section, a docstring per key.

Load with :func:`load_config` (``--config FILE.yaml`` plus dotted overrides such as
``--grpo.n_samples 4 --output_dir runs``). ``python launchers/grpo.py --help`` prints every key.
The mechanics (type checks, unknown-key suggestions) live in :mod:`megaforge.configtree`.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import yaml

from megaforge import configtree
from megaforge.config import aliases, paths
from megaforge.config.algo import AlgoConfig, CriticConfig, GRPOConfig, algo_components
from megaforge.config.evaluation import EvalConfig, EvalSetConfig
from megaforge.config.model import DataConfig, DType, ModelConfig
from megaforge.config.rewards import (JudgeConfig, RewardModelConfig, RewardsConfig, RewardSpec, check_reward_spec,
                                      reward_label)
from megaforge.config.rollout import RolloutConfig
from megaforge.config.root import Config
from megaforge.config.teacher import TeacherConfig
from megaforge.config.run import (CheckpointConfig, LaunchConfig, LoopConfig, MemoryConfig, MetricsConfig,
                                  SlurmConfig, SyncConfig)
from megaforge.config.trainer import SFTConfig, TrainerConfig
from megaforge.configtree import ConfigError

configtree.KEY_HINTS.append((aliases.hint, aliases.scalar_hint))  # torchforge / TRL / verl keys

__all__ = [
    "AlgoConfig", "CheckpointConfig", "Config", "ConfigError", "CriticConfig", "DataConfig", "DType", "EvalConfig",
    "EvalSetConfig", "GRPOConfig", "JudgeConfig", "LaunchConfig", "LoopConfig", "MemoryConfig", "MetricsConfig",
    "ModelConfig", "RewardModelConfig", "RewardSpec", "RewardsConfig", "RolloutConfig", "SFTConfig", "SlurmConfig",
    "SyncConfig", "TeacherConfig", "TrainerConfig", "algo_components", "check_reward_spec", "config_from_dict", "load_config",
    "reward_label", "save_config",
]


def load_config(argv: Optional[list[str]] = None, cls=Config) -> Config:
    """Parse ``argv`` (default ``sys.argv[1:]``); ``--help`` prints every key and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip() + "\n\n" + configtree.help_text(cls))
        raise SystemExit(0)
    return configtree.load(cls, argv, prepare=paths.config_relative)


def save_config(cfg: Config, path: str) -> None:
    """Write ``cfg`` as YAML to ``path`` (through ``path.tmp`` and a rename: never a half-written file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(configtree.to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)


def config_from_dict(data: dict, cls=Config) -> Config:
    """Build and check a ``cls`` from a nested dict (the YAML's form)."""
    return configtree.build(cls, data)
