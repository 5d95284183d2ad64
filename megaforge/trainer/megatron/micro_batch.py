"""The Megatron trainer's micro-batches: a share of a mini-batch's rows, packed into one ``thd``
sequence on first use (:class:`MicroBatch`), and the filler micro-batch that evens the micro-batch
count of data-parallel ranks for mixture-of-experts models (:func:`filler_rows`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.profiler import record_function

from megaforge.trainer.megatron.packing import Packed, pack, to_device
from megaforge.types import TrainBatch


class MicroBatch:
    """One micro-batch: its rows (host; ``num_tokens`` / ``num_seqs`` of the mini-batch) and, on
    first use, their packed form and device copy. The schedule's forward step touches them first, so
    the host packs micro-batch k+1 while the device still runs micro-batch k (packing everything
    up front would leave the device idle at the start of every step)."""

    def __init__(self, rows: TrainBatch, pack_fn, device, local_len: int, filler: bool = False):
        self.rows, self._pack_fn, self._device = rows, pack_fn, device
        self.local_len = local_len  # tokens of this rank's share of the packed sequence
        self.filler = filler  # padding of the micro-batch count (MoE): loss mask 0, results dropped
        self._packed: Optional[Packed] = None
        self._batch: Optional[TrainBatch] = None

    @property
    def packed(self) -> Packed:
        if self._packed is None:
            with record_function("megaforge.pack"):
                self._packed = self._pack_fn(self.rows)
        return self._packed

    @property
    def batch(self) -> TrainBatch:
        if self._batch is None:
            self._batch = self.rows.apply(lambda v: to_device(v, self._device))
        return self._batch


def filler_rows(local: TrainBatch) -> TrainBatch:
    """One row of two 0 tokens with every per-token field 0 (loss mask included) and the counts of
    ``local`` (the mini-batch's): a micro-batch that runs the model, and the experts' collectives,
    but contributes 0 to every loss term (each is masked by loss_mask) and so exactly 0 to the
    gradients."""
    kw = {}
    for name in TrainBatch.TENSOR_FIELDS:
        v = getattr(local, name)
        if v is not None:
            kw[name] = torch.zeros((1,) if name in TrainBatch.ROW_FIELDS else (1, 2), dtype=v.dtype)
    kw["lengths"] = torch.full((1,), 2, dtype=local.lengths.dtype)
    return TrainBatch(**kw, num_tokens=local.num_tokens, num_seqs=local.num_seqs)


def pack_rows(rows: TrainBatch, **kw) -> Packed:
    return pack(rows.tokens, rows.lengths, routes=rows.routed_experts, **kw)
