"""Reward functions and the manager that scores samples with time limits (in worker processes).

Registered names: ``math`` (:class:`MathReward`), ``thinking`` (:class:`ThinkingReward`). A user
reward is ``package.module:callable`` — a class (constructed with ``kwargs``) or a function
(called with ``kwargs`` as extra keyword arguments) of signature ``(prompt, response, target) -> float``.
Rewards run in worker processes (:mod:`megaforge.rewards.executor`), which build them from their
specs: a reward registered under a name must be registered by an ``algo.plugins`` module (the
workers import those too) or be given as ``package.module:callable``.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, Sequence

from megaforge.registry import Registry
from megaforge.rewards.verifiers import MathReward, ThinkingReward, extract_answer, last_boxed  # noqa: F401

REWARDS = Registry("reward")
REWARDS.register("math", MathReward)
REWARDS.register("thinking", ThinkingReward)


def build_reward(spec) -> Callable:
    obj = REWARDS.get(spec.name)
    if inspect.isclass(obj):
        try:
            return obj(**spec.kwargs)
        except TypeError as e:
            raise ValueError(f"reward {spec.name!r}: bad kwargs {spec.kwargs}: {e}") from e
    return functools.partial(obj, **spec.kwargs) if spec.kwargs else obj


class RewardError(RuntimeError):
    """A reward failed on every sample of a step (the run stops naming it)."""


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class RewardManager:
    """Scores (prompt, response, target) triples with the configured weighted rewards, in worker
    processes (:class:`megaforge.rewards.executor.RewardExecutor`).

    A reward call that raises, returns a non-finite or non-number value, or is not done within
    ``rewards.timeout_s`` of the phase's start scores 0 for that sample and is counted
    (``reward/errors``, ``reward/timeouts``); the last message is kept in ``last_error``. A step's
    reward phase therefore ends within about ``rewards.timeout_s`` however many calls hang (their
    workers are killed and replaced). :meth:`check_step` raises :class:`RewardError` when one
    reward failed on every sample since :meth:`start_step`: a reward that never works stops the run.
    """

    def __init__(self, cfg, plugins=()):
        from megaforge.rewards.executor import RewardCall, RewardExecutor

        self.cfg = cfg
        self.specs = list(cfg.functions)
        if not self.specs:
            raise ValueError("rewards.functions is empty: configure at least one reward")
        for s in self.specs:  # unknown names and missing modules fail here, before any worker starts
            REWARDS.get(s.name)
        self.names = [s.name.rsplit(":", 1)[-1] for s in self.specs]
        self._call = RewardCall
        self.executor = RewardExecutor(build_reward, self.specs, cfg.workers or default_workers(), cfg.timeout_s,
                                       plugins=list(plugins))
        self.last_error = ""
        self.start_step()

    def start_step(self) -> None:
        self._tally = {name: [0, 0, 0] for name in self.names}  # calls, errors, timeouts

    def score(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence) -> tuple[list[float], dict]:
        """Each sample's weighted reward sum, and the metrics: ``reward/<name>`` (mean unweighted value of
        each function), ``reward/errors``, ``reward/timeouts``."""
        totals, _, metrics = self.score_components(prompts, responses, targets)
        return totals, metrics

    def score_components(self, prompts: Sequence[str], responses: Sequence[str],
                         targets: Sequence) -> tuple[list[float], dict[str, list[float]], dict]:
        """As :meth:`score`, plus every function's unweighted value per sample: {name: [value, ...]}."""
        n, k = len(responses), len(self.specs)
        # sample-major: the rewards of one sample travel together, a hanging one holds back no other reward
        calls = [self._call(j, prompts[i], responses[i], targets[i]) for i in range(n) for j in range(k)]
        outcomes = self.executor.collect(self.executor.submit(calls))
        totals = [0.0] * n
        components: dict[str, list[float]] = {}
        metrics: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
        for j, (name, spec) in enumerate(zip(self.names, self.specs)):
            values = []
            for i, out in enumerate(outcomes[j::k]):
                tally = self._tally[name]
                tally[0] += 1
                if not out.ok:
                    kind = "reward/timeouts" if out.timed_out else "reward/errors"
                    metrics[kind] += 1
                    tally[2 if out.timed_out else 1] += 1
                    self.last_error = f"reward {spec.name!r} failed on sample {i}: {out.error}"
                v = out.value if out.ok else 0.0
                values.append(v)
                totals[i] += spec.weight * v
            components[name] = values
            metrics[f"reward/{name}"] = sum(values) / max(n, 1)
        return totals, components, metrics

    def check_step(self, step: int) -> None:
        """RewardError when a reward failed on every sample scored since :meth:`start_step`."""
        for name, (calls, errors, timeouts) in self._tally.items():
            if calls and errors + timeouts == calls:
                raise RewardError(
                    f"reward {name!r} failed on every sample of step {step} ({calls} calls: {timeouts} not done "
                    f"within rewards.timeout_s={self.cfg.timeout_s:g} s, {errors} raised or returned a non-number); "
                    f"last: {self.last_error}")

    def close(self):
        self.executor.close()
