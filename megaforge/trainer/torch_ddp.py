"""Data parallelism of the torch backend (policy and critic): DDP wrapping, gradient accumulation over
micro-batches, the clipped AdamW step.

Micro-batches are cut from a rank's rows ordered by length, longest first
(:func:`length_ordered_micro_batches`), and each is trimmed to its longest row, so rows of similar
length share a micro-batch and little padding is computed. The order changes nothing but float
summation order: every loss is a sum of per-row terms over global denominators (num_tokens /
num_seqs, :mod:`megaforge.algorithms.aggregation`), and every metric a sum of contributions (or a
maximum: :mod:`megaforge.algorithms.stats`).
Per-row results (log-probs, values) are put back in the rows' own order (:func:`per_row_results`).

Every rank trains on its rows of each mini-batch (:func:`megaforge.data.batch.share_of`). Losses
are contributions to the global objective (see megaforge.algorithms.aggregation), so gradients are
*summed* over ranks: DDP averages, hence each micro-batch's loss is multiplied by the world size.
"""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Iterable

import torch

from megaforge import collective
from megaforge.algorithms.stats import Stat, merge
from megaforge.data.batch import token_budget_runs
from megaforge.types import TrainBatch


def wrap(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` in DistributedDataParallel when the world has several ranks, else itself."""
    if collective.world() == 1:
        return module
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)


def rows_to_compute(batch: TrainBatch) -> TrainBatch:
    """The rows this rank computes per-token results (log-probs, values) for: a share's own rows, or
    the contiguous ``shard_range`` of a whole batch (gathered after: :func:`whole_or_share`)."""
    if batch.is_share:
        return batch
    lo, hi = collective.shard_range(batch.batch_size)
    return batch.select(slice(lo, hi))


def whole_or_share(local: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Per-token results [n, T] of :func:`rows_to_compute`'s rows -> the share's rows as they are, or
    the whole batch's [B, T] gathered on every rank."""
    return local if batch.is_share else collective.all_gather_rows(local, batch.batch_size)


def length_ordered(lengths: torch.Tensor, size: int, tokens: int = 0) -> list[torch.Tensor]:
    """Row indices [<= size] of each micro-batch: the rows sorted by length, longest first (a stable
    sort: rows of equal length keep their order), cut into runs of ``size`` rows, or with a token
    budget ``tokens`` > 0 (trainer.micro_batch_tokens) into runs of at most ``size`` rows whose rows x
    longest row stays <= ``tokens`` (:func:`megaforge.data.batch.token_budget_runs`)."""
    if lengths.numel() == 0:
        return []
    order = torch.sort(lengths, descending=True, stable=True).indices
    if not tokens:
        return list(order.split(size))
    return [order[a:b] for a, b in token_budget_runs(lengths[order].tolist(), size, tokens, padded=True)]


def padded_tokens(lengths: torch.Tensor, index: list[torch.Tensor]) -> int:
    """Positions the forwards of micro-batches ``index`` compute: sum over micro-batches of rows x
    the longest row (each micro-batch is trimmed to it)."""
    return sum(len(i) * int(lengths[i].max()) for i in index if len(i))


def length_ordered_micro_batches(rows: TrainBatch, size: int, tokens: int = 0) -> list[tuple[torch.Tensor, TrainBatch]]:
    """(row indices into ``rows``, micro-batch) of :func:`length_ordered`, each micro-batch trimmed
    to its longest row; the counts (num_tokens / num_seqs) stay the whole mini-batch's."""
    return [(i, rows.select(i)) for i in length_ordered(rows.lengths, size, tokens)]


def per_row_results(rows: TrainBatch, size: int, width: int, fn, tokens: int = 0) -> torch.Tensor:
    """``fn(micro_batch) -> [b, t]`` over the length-ordered micro-batches of ``rows``, put back in
    the order of ``rows``: [n, width] float32 on CPU, zero beyond each micro-batch's width t."""
    out = torch.zeros((rows.batch_size, width), dtype=torch.float32)
    for index, mb in length_ordered_micro_batches(rows, size, tokens):
        r = fn(mb)
        out[index, : r.shape[1]] = r.detach().float().cpu()
    return out


def accumulate(module: torch.nn.Module, rows: TrainBatch, micro_batch_size: int, loss_fn,
               tokens: int = 0) -> dict[str, Stat]:
    """Backward of ``loss_fn(micro_batch) -> (loss, {metric: Stat})`` over the length-ordered
    micro-batches of ``rows`` (:func:`length_ordered_micro_batches`; gradients all-reduced once, after
    the last one); returns the statistics combined over this rank's micro-batches on the device
    (:func:`~megaforge.algorithms.stats.merge`: nothing is read by the host, nothing reduced over
    ranks: the trainer does both once per call)."""
    scale = float(collective.world())
    total: dict[str, Stat] = {}
    mbs = [mb for _, mb in length_ordered_micro_batches(rows, micro_batch_size, tokens)]
    for i, mb in enumerate(mbs):
        sync = i == len(mbs) - 1 or not hasattr(module, "no_sync")
        with (contextlib.nullcontext() if sync else module.no_sync()):
            loss, metrics = loss_fn(mb)
            (loss * scale).backward()
        total = merge(total, metrics)
    return total


def clipped_step(named: Iterable[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer,
                 clip: float) -> tuple[float, bool]:
    """Clip the gradients of the ``named`` parameters (``module.named_parameters()``) to global norm
    ``clip`` (0: no clipping) and step ``opt``; a non-finite norm skips the step and says on stderr
    (main rank) which gradients were non-finite. Gradients are cleared either way. Returns (norm, stepped)."""
    named = [(n, p) for n, p in named if p.grad is not None]
    params = [p for _, p in named]
    if clip > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    else:
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])))
    stepped = math.isfinite(norm)
    if stepped:
        opt.step()
    elif collective.is_main():
        print(f"[megaforge] optimizer update skipped: {non_finite_report(named)}", file=sys.stderr, flush=True)
    opt.zero_grad(set_to_none=True)
    return norm, stepped


def non_finite_report(named: list[tuple[str, torch.nn.Parameter]], show: int = 3) -> str:
    """Which of the ``named`` parameters' gradients hold NaN / inf: the first ``show`` names and the count."""
    bad = [n for n, p in named if not bool(torch.isfinite(p.grad).all())]
    more = f" and {len(bad) - show} more" if len(bad) > show else ""
    return (f"non-finite gradient in {len(bad)} of {len(named)} tensors ({', '.join(bad[:show])}{more})" if bad
            else f"the gradient norm over {len(named)} finite tensors overflowed")


def adamw(params, lr: float, t) -> torch.optim.AdamW:
    """AdamW with trainer config ``t``'s betas, eps and weight decay."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
