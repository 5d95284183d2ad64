"""Reward functions, reward services and the manager that scores samples with time limits (in
worker processes).

Registered names: ``math`` (:class:`MathReward`), ``thinking`` (:class:`ThinkingReward`),
``remote`` (an HTTP reward service, :mod:`megaforge.rewards.remote`; served by
``python -m megaforge.rewards.serve``), ``reward_model`` (a Hugging Face sequence-classification
checkpoint, :mod:`megaforge.rewards.reward_model`), ``llm_judge`` (a generative judge through a
megaforge engine, :mod:`megaforge.rewards.judge`). A user reward is ``package.module:callable`` —
a class (constructed with ``kwargs``) or a function (called with ``kwargs`` as extra keyword
arguments) of signature ``(prompt, response, target) -> float``; batched and group-level rewards:
:mod:`megaforge.rewards.build`, :mod:`megaforge.rewards.executor`. Rewards run in worker processes
(:mod:`megaforge.rewards.executor`), which build them from their specs: a reward registered under a
name must be registered by an ``algo.plugins`` module (the workers import those too) or be given as
``package.module:callable``.
"""
from __future__ import annotations

from megaforge.rewards.build import REWARDS, build_reward, own_workers, reward_level  # noqa: F401
from megaforge.rewards.manager import RewardError, RewardManager, RewardStream, default_workers  # noqa: F401
from megaforge.rewards.verifiers import MathReward, ThinkingReward, extract_answer, last_boxed  # noqa: F401
