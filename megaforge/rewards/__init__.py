"""Reward functions and the manager that scores samples with time limits.

Registered names: ``math`` (:class:`MathReward`), ``thinking`` (:class:`ThinkingReward`). A user
reward is ``package.module:callable`` — a class (constructed with ``kwargs``) or a function
(called with ``kwargs`` as extra keyword arguments) of signature ``(prompt, response, target) -> float``.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import inspect
import math
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
    pass


class RewardManager:
    """Scores (prompt, response, target) triples with the configured weighted rewards.

    Each call is bounded by ``rewards.timeout_s``: a reward that raises or runs over scores 0 for that
    sample and is counted (``reward/errors``, ``reward/timeouts``); the first error message is kept
    in ``last_error``. A reward returning a non-finite or non-number value is an error too.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.specs = list(cfg.functions)
        if not self.specs:
            raise ValueError("rewards.functions is empty: configure at least one reward")
        self.fns = [build_reward(s) for s in self.specs]
        self.names = [s.name.rsplit(":", 1)[-1] for s in self.specs]
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, cfg.workers or 4), thread_name_prefix="reward")
        self.last_error = ""

    def score(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence) -> tuple[list[float], dict]:
        """Each sample's weighted reward sum, and the metrics: ``reward/<name>`` (mean unweighted value of
        each function), ``reward/errors``, ``reward/timeouts``."""
        totals, _, metrics = self.score_components(prompts, responses, targets)
        return totals, metrics

    def score_components(self, prompts: Sequence[str], responses: Sequence[str],
                         targets: Sequence) -> tuple[list[float], dict[str, list[float]], dict]:
        """As :meth:`score`, plus every function's unweighted value per sample: {name: [value, ...]}."""
        n = len(responses)
        totals = [0.0] * n
        components: dict[str, list[float]] = {}
        metrics: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
        for name, spec, fn in zip(self.names, self.specs, self.fns):
            futures = [self._pool.submit(fn, prompts[i], responses[i], targets[i]) for i in range(n)]
            values = []
            for i, fut in enumerate(futures):
                try:
                    v = fut.result(timeout=self.cfg.timeout_s)
                    v = float(v)
                    if not math.isfinite(v):
                        raise RewardError(f"returned {v}")
                except cf.TimeoutError:
                    metrics["reward/timeouts"] += 1
                    self.last_error = f"reward {spec.name!r} took more than rewards.timeout_s={self.cfg.timeout_s}s"
                    v = 0.0
                except Exception as e:  # a user reward may raise anything: score 0, count, keep the message
                    metrics["reward/errors"] += 1
                    self.last_error = f"reward {spec.name!r} failed on sample {i}: {type(e).__name__}: {e}"
                    v = 0.0
                values.append(v)
                totals[i] += spec.weight * v
            components[name] = values
            metrics[f"reward/{name}"] = sum(values) / max(n, 1)
        return totals, components, metrics

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
