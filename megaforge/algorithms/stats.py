"""Statistics of one micro-batch, returned as values with the reduction they declare.

A loss function returns ``(loss, {name: Stat})``; each :class:`Stat` is a 0-d tensor on the compute
device (no gradient) and how the trainer combines it, declared where it is computed:

* ``sum`` (:func:`contribution`, :func:`token_mean`): a *contribution* already divided by a global
  count (the mini-batch's trained tokens or sequences), so the value of one optimizer update is the
  sum over its micro-batches and data-parallel ranks, e.g. ``token_mean``: sum_{i,t} x_it m_it / N_tok
  per micro-batch adds up to the mini-batch's token mean. A call of several updates (mini-batches x
  epochs) reports the mean of its updates' values.
* ``max`` (:func:`largest`): the maximum over micro-batches, ranks and updates.

The trainer adds micro-batches up on the device (:func:`merge`, no host read), reduces over ranks
once per call and copies to the host once (:mod:`megaforge.trainer.metrics`). Values accumulate in
float64: sums of ~10^3 float32 contributions stay exact to float32 rounding of each term.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

SUM, MAX = "sum", "max"
REDUCTIONS = (SUM, MAX)


@dataclass(frozen=True)
class Stat:
    """A micro-batch statistic: ``value`` a 0-d tensor (detached, on the compute device) and
    ``reduce`` in :data:`REDUCTIONS` (module docstring)."""

    value: torch.Tensor
    reduce: str = SUM

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Stat.reduce must be one of {REDUCTIONS}, got {self.reduce!r}")
        if self.value.dim() != 0:
            raise ValueError(f"Stat.value must be a 0-d tensor, got shape {tuple(self.value.shape)}")

    def __float__(self) -> float:
        """The value on the host (a device sync: for tests and debugging, not the training path)."""
        return float(self.value)


def contribution(value: torch.Tensor) -> Stat:
    """A scalar contribution (already divided by its global count): summed over micro-batches and ranks."""
    return Stat(value.detach(), SUM)


def token_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: int) -> Stat:
    """Contribution of a per-token quantity ``x`` [B, T] to its mean over the global batch's
    ``num_tokens`` trained tokens: sum_{i,t} x_it mask_it / num_tokens."""
    return Stat((x.detach() * mask).sum() / num_tokens, SUM)


def largest(value: torch.Tensor) -> Stat:
    """A value reduced by maximum over micro-batches, ranks and updates."""
    return Stat(value.detach(), MAX)


def as_stat(v) -> Stat:
    """``v`` as a :class:`Stat`: itself, or a bare 0-d tensor as a ``sum`` contribution."""
    return v if isinstance(v, Stat) else contribution(torch.as_tensor(v))


def merge(total: Optional[Mapping[str, Stat]], new: Mapping[str, Stat]) -> dict[str, Stat]:
    """``total`` combined with ``new`` key by key on the device (float64): sum or max per the declared
    reduction; a key present in one only is kept as it is. No host read. ValueError when a key
    changes its reduction."""
    out = dict(total or {})
    for k, v in new.items():
        v = as_stat(v)
        value = v.value.detach().to(torch.float64)
        old = out.get(k)
        if old is None:
            out[k] = Stat(value, v.reduce)
            continue
        if old.reduce != v.reduce:
            raise ValueError(f"metric {k!r}: reduction {v.reduce!r} after {old.reduce!r}")
        combined = old.value + value if v.reduce == SUM else torch.maximum(old.value, value)
        out[k] = Stat(combined, v.reduce)
    return out
