"""The reward registry and how a ``rewards.functions`` entry becomes a callable.

Declarations a registry entry may carry (``REWARDS.register(name, obj, **declared)``):

* ``level="group"``: a group-level reward, called once per group as
  ``fn(prompt, responses, target) -> list[float]`` (one value per response of the group: the
  samples of one prompt), e.g. a ranking judge or a normalisation. A ``package.module:callable``
  plug-in declares it with an attribute ``reward_level = "group"``.
* ``workers=N``: by default the reward gets a worker pool of its own of N processes (it holds a
  model: each process loads one copy), and stalled calls start no spare workers.
* ``from_spec=True``: built by ``obj.from_spec(spec)`` from its typed keys (``url``,
  ``reward_model``, ``judge``) instead of ``obj(**kwargs)``.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

from megaforge.registry import Registry
from megaforge.rewards.judge import LLMJudge
from megaforge.rewards.remote import RemoteReward
from megaforge.rewards.reward_model import RewardModel
from megaforge.rewards.verifiers import MathReward, ThinkingReward

REWARDS = Registry("reward")
REWARDS.register("math", MathReward)
REWARDS.register("thinking", ThinkingReward)
REWARDS.register("remote", RemoteReward, from_spec=True)
REWARDS.register("reward_model", RewardModel, from_spec=True, workers=1)
REWARDS.register("llm_judge", LLMJudge, from_spec=True, workers=1)


def build_reward(spec) -> Callable:
    """The callable of one ``rewards.functions`` entry (built in each reward worker)."""
    obj = REWARDS.get(spec.name)
    if REWARDS.declared(spec.name).get("from_spec"):
        if spec.kwargs:
            raise ValueError(f"reward {spec.name!r} is configured by its own keys, not kwargs (got {spec.kwargs})")
        return obj.from_spec(spec)
    if inspect.isclass(obj):
        try:
            return obj(**spec.kwargs)
        except TypeError as e:
            raise ValueError(f"reward {spec.name!r}: bad kwargs {spec.kwargs}: {e}") from e
    return functools.partial(obj, **spec.kwargs) if spec.kwargs else obj


def reward_level(spec) -> str:
    """``"group"`` for a group-level reward (see the module docstring), else ``"sample"``."""
    level = REWARDS.declared(spec.name).get("level") or getattr(REWARDS.get(spec.name), "reward_level", "sample")
    if level not in ("sample", "group"):
        raise ValueError(f"reward {spec.name!r} declares level {level!r}; valid: sample, group")
    return level


def own_workers(spec) -> Optional[int]:
    """Processes of the reward's own pool (``spec.workers``, else its declaration); None: the shared pool."""
    if spec.workers is not None:
        return spec.workers
    return REWARDS.declared(spec.name).get("workers")
