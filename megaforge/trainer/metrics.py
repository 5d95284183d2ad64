"""The metrics of one trainer call (``train_step``, ``sft_step``, the critic's updates), reduced once.

A call runs U optimizer updates (mini-batches x epochs, those without a trained token skipped). Two
kinds of values reach :class:`StepMetrics`:

* the micro-batch statistics of each update (:class:`~megaforge.algorithms.stats.Stat`: 0-d device
  tensors, each declaring ``sum`` or ``max``), added up on the device across micro-batches *and*
  updates (:func:`~megaforge.algorithms.stats.merge`: no host read). At the end of the call they
  are reduced over the data-parallel ranks by one collective per reduction kind of one stacked
  tensor, the ``sum`` entries divided by U (the mean of the updates' values: summing over ranks and
  averaging over updates commute), and copied to the host once;
* the values of each update itself, already on the host and equal on every rank (the gradient norm,
  which the finite check reads anyway, the learning rate, whether the step was skipped): ``mean``
  over the updates, or ``count`` (summed over them).

So a call of N micro-batches and U updates reads the device U times (the gradient norms) plus once
(all the metrics), where it read it once per metric and micro-batch before; the metrics' reduction
and copy start before the last optimizer step and are read after it (:func:`to_host_later`). The
counts: ``skipped`` (updates whose gradient norm was not finite), ``updates`` (U, skipped ones
included) and ``empty_minibatches`` (mini-batches without a trained token: no update runs for them).
A key present in some updates only is still divided by U (its value is 0 in the others).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from megaforge.algorithms.stats import MAX, SUM, Stat, merge

#: the reductions of an update's own host values
MEAN, COUNT = "mean", "count"

#: ``reduce(vector [k] float64 on the device, op "sum" | "max") -> vector``: the collective over the
#: data-parallel ranks (identity with one rank)
RankReduce = Callable[[torch.Tensor, str], torch.Tensor]


def stack_and_reduce(stats: Mapping[str, Stat], updates: int, reduce: RankReduce) -> tuple[list[str], torch.Tensor]:
    """(sorted keys, values [k] float64 on the device) of accumulated ``stats``: the ``sum`` entries
    reduced over ranks in one collective and divided by ``updates``, the ``max`` entries in another
    (only when there are any)."""
    keys = sorted(stats)
    parts, order = [], []
    for kind in (SUM, MAX):
        ks = [k for k in keys if stats[k].reduce == kind]
        if not ks:
            continue
        vec = reduce(torch.stack([stats[k].value for k in ks]), kind)
        parts.append(vec / max(updates, 1) if kind == SUM else vec)
        order += ks
    if not parts:
        return [], torch.zeros(0, dtype=torch.float64)
    vec = torch.cat(parts)
    pos = {k: i for i, k in enumerate(order)}
    return keys, vec[torch.tensor([pos[k] for k in keys], device=vec.device)]


class StepMetrics:
    """Accumulates one call's metrics (module docstring). Per update: :meth:`add_stats`, then
    :meth:`add_values`; after the last update's statistics (before its optimizer step, so that their
    reduction and copy overlap it) :meth:`start_to_host`; then :meth:`result`."""

    def __init__(self):
        self.stats: Optional[dict[str, Stat]] = None  # device accumulators of the micro-batch stats
        self.host: dict[str, tuple[float, str]] = {}  # update values: (total, MEAN | COUNT)
        self.updates = 0
        self.empty = 0

    def add_stats(self, stats: Mapping[str, Stat]) -> None:
        """One update's micro-batch ``stats``, summed over its micro-batches on this rank (device)."""
        self.stats = merge(self.stats, stats)
        self.updates += 1

    def add_values(self, values: Mapping[str, tuple[float, str]]) -> None:
        """One update's own ``values`` {name: (value, MEAN | COUNT)} (host, equal on every rank)."""
        for k, (v, kind) in values.items():
            if kind not in (MEAN, COUNT):
                raise ValueError(f"update value {k!r}: reduction must be {MEAN!r} or {COUNT!r}, got {kind!r}")
            total, _ = self.host.get(k, (0.0, kind))
            self.host[k] = (total + float(v), kind)

    def add_empty(self) -> None:
        self.empty += 1

    def start_to_host(self, to_host: Callable[[Mapping[str, Stat], int], Callable[[], dict[str, float]]]):
        """``to_host(stats, updates)``: the backend's reduction over ranks, started with the copy to the
        host (:meth:`megaforge.trainer.base.Trainer._stats_to_host`; collective: every rank calls it,
        with no stats when there was no update); returns the reader of the host dict."""
        return to_host(self.stats or {}, self.updates)

    def result(self, read: Callable[[], dict[str, float]], counts: bool = True) -> dict[str, float]:
        """The call's metrics on the host: the micro-batch statistics (``read()``, what
        :meth:`start_to_host` returned), then the update values. With ``counts``: ``skipped`` (0
        without updates), ``updates``, ``empty_minibatches``."""
        out = read()
        if self.updates:
            out.update({k: (v / self.updates if kind == MEAN else v) for k, (v, kind) in self.host.items()})
        if counts:
            out.setdefault("skipped", 0.0)
            out["updates"] = float(self.updates)
            out["empty_minibatches"] = float(self.empty)
        return out


def world_stats_to_host(stats: Mapping[str, Stat], updates: int, reduce: RankReduce) -> Callable[[], dict[str, float]]:
    """:func:`stack_and_reduce` with ``reduce`` (every rank holds statistics), then one copy to the
    host (:func:`to_host_later`); returns its reader."""
    if not stats:
        return dict
    keys, vec = stack_and_reduce(stats, updates, reduce)
    values = to_host_later(vec)
    return lambda: dict(zip(keys, values()))


def to_host_later(t: torch.Tensor) -> Callable[[], list[float]]:
    """Start copying device tensor ``t`` [k] to pinned host memory; returns a function giving its
    values (a list of floats) once the copy has landed. Started before the last optimizer step and
    read after it (whose gradient norm syncs the device anyway), it costs no extra sync: reading it
    first would drain the device once more, and waiting for the whole step would keep the next
    step's host work from overlapping the optimizer's kernels. On the CPU: ``t.tolist()``."""
    if t.device.type != "cuda":
        return lambda: [float(v) for v in t.tolist()]
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def values():
        done.synchronize()
        return [float(v) for v in host.tolist()]

    return values
