"""The reward manager: the configured rewards in worker pools, scored as samples arrive.

    manager = RewardManager(cfg.rewards, plugins)
    stream = manager.stream()
    stream.add(prompts, responses, targets, group_ids)   # submitted at once; call again as more finish
    totals, metrics = stream.finish()                     # waits for the rest; in the order added
    manager.check_step(step)                              # RewardError if a reward failed on every sample

Pools: rewards share one pool of ``rewards.workers`` processes unless they have a pool of their own
(``workers`` of their entry, or their registry declaration: reward models and judges, one process
each, since every process holds a copy of the model). Each pool is a
:class:`megaforge.rewards.executor.RewardExecutor`.

Metrics of :meth:`RewardStream.finish`: ``reward/<label>`` (mean over the samples, failed ones 0),
``reward/errors`` / ``reward/timeouts`` (samples whose reward failed / timed out, per reward),
``time/reward`` (from the first submission to the last outcome: the rewards' span, which overlaps
generation when samples were added while it ran) and ``time/reward_wait`` (spent in ``finish``:
after generation ended).
"""
from __future__ import annotations

import collections
import os
import time
from typing import Optional, Sequence

from megaforge.config import reward_label
from megaforge.rewards.build import REWARDS, build_reward, own_workers, reward_level
from megaforge.rewards.executor import RewardCall, RewardExecutor


class RewardError(RuntimeError):
    """A reward failed on every sample of a step (the run stops naming it)."""


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class RewardManager:
    """Scores (prompt, response, target) triples with the configured weighted rewards, in worker
    processes (see the module docstring).

    A reward call that raises, returns a value that is not a reward (:mod:`megaforge.rewards.values`),
    or is not done within ``rewards.timeout_s`` of its start scores 0 for its samples and is counted
    (``reward/errors``, ``reward/timeouts``); the last message is kept in ``last_error``, each
    reward's last one since :meth:`start_step` in ``step_errors``. Hanging calls' workers are killed
    and replaced, so the calls queued behind them run; a reward whose calls keep timing out is given
    up on for the rest of the phase (:mod:`megaforge.rewards.executor`). :meth:`check_step` raises :class:`RewardError` when one
    reward failed on every sample since :meth:`start_step`: a reward that never works stops the run.
    """

    def __init__(self, cfg, plugins=()):
        self.cfg = cfg
        self.specs = list(cfg.functions)
        if not self.specs:
            raise ValueError("rewards.functions is empty: configure at least one reward")
        for s in self.specs:  # unknown names and missing modules fail here, before any worker starts
            REWARDS.get(s.name)
        self.names = [reward_label(s) for s in self.specs]
        dup = [n for n, k in collections.Counter(self.names).items() if k > 1]
        if dup:
            raise ValueError(f"rewards.functions: reward label {dup[0]!r} is used twice: give each a label")
        self.levels = [reward_level(s) for s in self.specs]
        shared = [j for j, s in enumerate(self.specs) if own_workers(s) is None]
        plans = ([(shared, cfg.workers or default_workers(), True)] if shared else []) + \
                [([j], own_workers(s), False) for j, s in enumerate(self.specs) if own_workers(s) is not None]
        self.pools: list[RewardExecutor] = []
        self._route: dict[int, tuple[int, int]] = {}  # reward index -> (pool, index in the pool)
        try:
            for members, workers, spares in plans:
                self.pools.append(RewardExecutor(build_reward, [self.specs[j] for j in members], workers,
                                                 cfg.timeout_s, plugins=list(plugins),
                                                 start_timeout_s=cfg.start_timeout_s,
                                                 levels=[self.levels[j] for j in members], spares=spares))
                for k, j in enumerate(members):
                    self._route[j] = (len(self.pools) - 1, k)
        except BaseException:
            self.close()
            raise
        self.executor = self.pools[self._route[0][0]]  # the pool of the first reward
        self._call = RewardCall
        self.last_error = ""
        self.start_step()

    def start_step(self) -> None:
        self._tally = {name: [0, 0, 0] for name in self.names}  # calls, errors, timeouts
        self.step_errors: dict[str, str] = {}  # label -> its last failure message since start_step

    def stream(self) -> "RewardStream":
        """A reward phase whose samples are added as they are generated."""
        return RewardStream(self)

    def score(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence,
              group_ids: Optional[Sequence[int]] = None) -> tuple[list[float], dict]:
        """All at once: ``stream(); add(...); finish()``."""
        s = self.stream()
        s.add(prompts, responses, targets, group_ids)
        return s.finish()

    def score_components(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence,
                         group_ids: Optional[Sequence[int]] = None) -> tuple[list[float], dict[str, list[float]], dict]:
        """As :meth:`score`, plus every function's unweighted value per sample: {name: [value, ...]}
        (0 where it failed)."""
        s = self.stream()
        s.add(prompts, responses, targets, group_ids)
        totals, metrics = s.finish()
        return totals, s.components, metrics

    def check_step(self, step: int) -> None:
        """RewardError when a reward failed on every sample scored since :meth:`start_step`."""
        for name, (calls, errors, timeouts) in self._tally.items():
            if calls and errors + timeouts == calls:
                raise RewardError(
                    f"reward {name!r} failed on every sample of step {step} ({calls} calls: {timeouts} not done "
                    f"within rewards.timeout_s={self.cfg.timeout_s:g} s, {errors} raised or returned a non-number); "
                    f"last: {self.last_error}")

    def close(self):
        for p in self.pools:
            p.close()
        self.pools = []


class RewardStream:
    """One reward phase: :meth:`add` submits the rewards of finished samples at once (sample-level
    rewards per sample, group-level ones per group: a group's samples must come in one call),
    :meth:`finish` waits for the rest. See the module docstring for the metrics."""

    def __init__(self, manager: RewardManager):
        self.m = manager
        self.n = 0
        self.components: dict[str, list[float]] = {}  # {reward: [value per sample]} after finish()
        self._tickets: list[tuple[int, list[int], list[tuple[int, list[int], str]]]] = []
        self._groups: set = set()
        self._first: Optional[float] = None

    def add_samples(self, samples) -> None:
        """:meth:`add` for :class:`megaforge.types.Sample` records (prompt_text, response_text, label, group_id)."""
        self.add([s.prompt_text for s in samples], [s.response_text for s in samples], [s.label for s in samples],
                 [s.group_id for s in samples])

    def add(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence,
            group_ids: Optional[Sequence[int]] = None) -> None:
        m, n, base = self.m, len(responses), self.n
        if len(prompts) != n or len(targets) != n or (group_ids is not None and len(group_ids) != n):
            raise ValueError(f"RewardStream.add: {len(prompts)} prompts, {n} responses, {len(targets)} targets"
                             f"{'' if group_ids is None else f', {len(group_ids)} group ids'}: they must match")
        calls: dict[int, list] = collections.defaultdict(list)
        entries: dict[int, list] = collections.defaultdict(list)  # pool -> (reward, sample indices, where)

        def put(j: int, call_args: tuple, idx: list[int], where: str) -> None:
            pool, fn = m._route[j]
            calls[pool].append(RewardCall(fn, *call_args))
            entries[pool].append((j, idx, where))

        per_sample = [j for j, lv in enumerate(m.levels) if lv == "sample"]
        for i in range(n):  # sample-major: the rewards of one sample travel together
            for j in per_sample:
                put(j, (prompts[i], responses[i], targets[i]), [base + i], f"sample {base + i}")
        per_group = [j for j, lv in enumerate(m.levels) if lv == "group"]
        if per_group:
            for gid, idx in self._split_groups(prompts, targets, group_ids, per_group).items():
                for j in per_group:
                    put(j, (prompts[idx[0]], [responses[i] for i in idx], targets[idx[0]]), [base + i for i in idx],
                        f"group {gid} (samples {base + idx[0]}..{base + idx[-1]})")
        self.n += n
        if self._first is None:
            self._first = time.monotonic()
        for pool in calls:
            self._tickets.append((pool, m.pools[pool].submit(calls[pool]), entries[pool]))

    def _split_groups(self, prompts, targets, group_ids, per_group) -> dict:
        if group_ids is None:
            raise ValueError(f"reward {self.m.names[per_group[0]]!r} is group-level: scoring needs the samples' "
                             f"group ids")
        groups: dict = {}
        for i, g in enumerate(group_ids):
            groups.setdefault(g, []).append(i)
        for g, idx in groups.items():
            if g in self._groups:
                raise ValueError(f"group {g} was already added to this reward phase: a group-level reward needs "
                                 f"all samples of a group in one add()")
            if any(prompts[i] != prompts[idx[0]] or targets[i] != targets[idx[0]] for i in idx):
                raise ValueError(f"group {g}: its samples have different prompts or targets")
        self._groups.update(groups)
        return groups

    def finish(self) -> tuple[list[float], dict]:
        """Each sample's weighted reward (in the order added) and the phase's metrics."""
        m = self.m
        t = time.monotonic()
        done = [(entries, m.pools[pool].collect(ids)) for pool, ids, entries in self._tickets]
        wait = time.monotonic() - t
        totals = [0.0] * self.n
        sums = [0.0] * len(m.specs)
        self.components = {name: [0.0] * self.n for name in m.names}
        metrics: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
        last_at = self._first or t
        for entries, outcomes in done:
            for (j, idx, where), out in zip(entries, outcomes):
                name, spec = m.names[j], m.specs[j]
                tally = m._tally[name]
                tally[0] += len(idx)
                last_at = max(last_at, out.at)
                if not out.ok:
                    kind = "reward/timeouts" if out.timed_out else "reward/errors"
                    metrics[kind] += len(idx)
                    tally[2 if out.timed_out else 1] += len(idx)
                    who = f"{name!r} ({spec.name})" if spec.label else repr(spec.name)
                    m.last_error = m.step_errors[name] = f"reward {who} failed on {where}: {out.error}"
                    continue
                values = out.value if isinstance(out.value, list) else [out.value]
                for i, v in zip(idx, values):
                    totals[i] += spec.weight * v
                    sums[j] += v
                    self.components[name][i] = v
        for j, name in enumerate(m.names):
            metrics[f"reward/{name}"] = sums[j] / max(self.n, 1)
        metrics["time/reward"] = (last_at - self._first) if self._first is not None else 0.0
        metrics["time/reward_wait"] = wait
        self._tickets = []
        return totals, metrics
