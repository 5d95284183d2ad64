"""The batch hand-off: the main rank builds each step's whole TrainBatch; every rank receives its
data-parallel *share* (:func:`megaforge.data.batch.share_of`) as tensors, point to point.

    main rank                                         rank r (r != 0), of DP rank d
      error or None, B       -- broadcast (tiny) -->    every rank stops together on a bad batch
      for every DP rank d: share_of(batch, m, d, DP)
      header [4 + F + 2 + 4 m] int64  -- send -->           counts, share shape, dtypes, mini-batch layout
      each tensor field that is set -- send -->         the share's tensors
    only when the advantages need the trainer's results (BatchHandOff.sequences, below):
      rewards [B], group ids [B]  -- broadcast -->      the whole batch's, on every rank
      the estimators' batch sums / maxima  <-- all-reduce -->  a few float64 scalars

Header: the whole batch's ``num_tokens`` and ``num_seqs``, the share's rows ``n`` and columns ``T``, one
dtype code per tensor field (F of them; -1: not set), the trailing dimensions of the fields that have
them (``routed_experts`` [n, T, layers, topk]: layers, topk; 0s when not set), then per mini-batch (m = ``trainer.mini_batches``)
the share's rows of it, the mini-batch's rows, ``num_tokens`` and ``num_seqs``. Model-parallel peers of
one DP rank (megatron's TP / CP / PP ranks) receive the same share. A rank thus receives
``8 (4 + F + 2 + 4 m) + n (T * s_tok + s_row)`` bytes, with ``s_tok`` / ``s_row`` the element bytes of the
per-token / per-row fields set: about 1/DP of the batch.

Per-token results (reference / old log-probs, values) stay on their rank, and so does everything
computed from them. When the advantages need them (``algo.kl_in_reward``'s penalty, critic values),
every rank computes its share's advantages itself: :meth:`BatchHandOff.sequences` gives every rank the
whole batch's rewards and group ids ([B] each: groups may span shares, so each rank computes the group
statistics of the whole batch and picks its rows) and the
:class:`~megaforge.algorithms.core.Share` through which the estimators add up batch-wide statistics
(whitening: a few float64 scalars, all-reduced over the ranks, each DP rank counted once). No
per-token tensor travels back to the main rank.

Every method is collective over the world. Byte counts: :attr:`BatchHandOff.received` /
:attr:`BatchHandOff.sent` (tensors only, headers included, since the last :meth:`BatchHandOff.share`;
an all-reduce counts its tensor's bytes once each way).
"""
from __future__ import annotations

from typing import Optional

import torch

from megaforge import collective
from megaforge.algorithms.core import Share
from megaforge.data.batch import share_of, share_rows
from megaforge.types import MiniBatchPart, TrainBatch

FIELDS = TrainBatch.TENSOR_FIELDS
#: the dtypes a handed-off tensor may have (its header code is the index)
DTYPES = (torch.int64, torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.float16, torch.bool,
          torch.uint8, torch.int16)
#: per-token fields with trailing dimensions ([n, T, *dims]): their dims travel in the header (0s: not set)
TRAILING = {"routed_experts": 2}


def dtype_code(name: str, t: Optional[torch.Tensor]) -> int:
    """The header code of field ``name`` holding ``t`` (-1: None); ValueError for a dtype not in DTYPES."""
    if t is None:
        return -1
    if t.dtype not in DTYPES:
        raise ValueError(f"TrainBatch.{name}: dtype {t.dtype} cannot be handed off (valid: {DTYPES})")
    return DTYPES.index(t.dtype)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class BatchHandOff:
    """Hands every rank its share of the main rank's batches (see the module docstring).

    ``dp_rank`` / ``dp_size``: this rank's data-parallel coordinates (the trainer's
    :meth:`~megaforge.trainer.base.Trainer.data_parallel`); ``mini_batches``: ``trainer.mini_batches``."""

    def __init__(self, dp_rank: int, dp_size: int, mini_batches: int):
        coords = collective.all_gather_ints([dp_rank, dp_size])
        if any(size != dp_size for _, size in coords):
            raise RuntimeError(f"ranks disagree on the data-parallel size: {[size for _, size in coords]}")
        self.dp_of = [d for d, _ in coords]  # the DP rank of every global rank
        self.dp_rank, self.dp_size, self.mini_batches = dp_rank, dp_size, mini_batches
        self.sent = self.received = 0
        self.counted = self._ranks_of(dp_rank)[0] == collective.rank()  # this DP rank's partials in sums
        self._batch_size = 0  # every rank: rows of the last whole batch handed off
        self._codes: list[int] = []  # every rank: the dtype code of every field of it (-1: not set)

    def _ranks_of(self, d: int) -> list[int]:
        return [r for r, dd in enumerate(self.dp_of) if dd == d]

    def _send(self, t: torch.Tensor, dst: int) -> None:
        collective.send_tensor(t, dst)
        self.sent += nbytes(t)

    def _recv(self, shape, dtype: torch.dtype, src: int = 0) -> torch.Tensor:
        t = collective.recv_tensor(shape, dtype, src)
        self.received += nbytes(t)
        return t

    # ------------------------------------------------------------------------------- the batch
    def share(self, batch: Optional[TrainBatch]) -> TrainBatch:
        """This rank's share of ``batch`` (the whole batch on the main rank, None on the others).
        ValueError on every rank when the batch cannot be handed off (a dtype, too few rows)."""
        self.sent = self.received = 0
        err, codes = None, []
        if collective.is_main():
            try:
                codes = [dtype_code(n, getattr(batch, n)) for n in FIELDS]
                share_rows(batch.batch_size, self.mini_batches, 0, self.dp_size)
            except ValueError as e:
                err = str(e)
        err, self._batch_size = collective.broadcast_object((err, batch.batch_size if collective.is_main() else 0))
        self._codes = codes  # the other ranks': from their header
        if err:
            raise ValueError(err)
        if not collective.is_main():
            return self._receive()
        mine = None
        for d in range(self.dp_size):
            share = share_of(batch, self.mini_batches, d, self.dp_size)
            header = self._header(share, codes)
            for r in self._ranks_of(d):
                if r == 0:
                    mine = share
                    continue
                self._send(header, r)
                for name, c in zip(FIELDS, codes):
                    if c >= 0:
                        self._send(getattr(share, name), r)
        return mine

    @staticmethod
    def _header(share: TrainBatch, codes: list[int]) -> torch.Tensor:
        h = [share.num_tokens, share.num_seqs, share.batch_size, int(share.tokens.shape[1]), *codes]
        for name, k in TRAILING.items():
            t = getattr(share, name)
            h += list(t.shape[2:]) if t is not None else [0] * k
        for p in share.minis:
            h += [p.hi - p.lo, p.size, p.num_tokens, p.num_seqs]
        return torch.tensor(h, dtype=torch.long)

    def _receive(self) -> TrainBatch:
        extra = sum(TRAILING.values())
        h = self._recv((4 + len(FIELDS) + extra + 4 * self.mini_batches,), torch.long).tolist()
        num_tokens, num_seqs, n, T = h[:4]
        codes, rest = h[4:4 + len(FIELDS)], h[4 + len(FIELDS) + extra:]
        dims, i = {}, 4 + len(FIELDS)
        for name, k in TRAILING.items():
            dims[name], i = tuple(h[i:i + k]), i + k
        self._codes = codes
        minis, lo = [], 0
        for k in range(self.mini_batches):
            count, size, ntok, nseq = rest[4 * k:4 * k + 4]
            minis.append(MiniBatchPart(lo, lo + count, size, ntok, nseq))
            lo += count
        fields = {name: (None if c < 0 else self._recv((n,) if name in TrainBatch.ROW_FIELDS else (n, T, *dims.get(name, ())),
                                                       DTYPES[c]))
                  for name, c in zip(FIELDS, codes)}
        return TrainBatch(**fields, num_tokens=num_tokens, num_seqs=num_seqs, minis=tuple(minis))

    # ------------------------------------------------- what the advantages of a share need of the batch
    def sequences(self, batch: Optional[TrainBatch]) -> tuple[torch.Tensor, torch.Tensor, Share]:
        """After :meth:`share` of ``batch`` (the whole batch on the main rank, None elsewhere): the whole
        batch's rewards [B] and group ids [B] on every rank (broadcast from the main rank) and this
        rank's :class:`~megaforge.algorithms.core.Share` of it (its rows; sums and maxima over the DP
        ranks, :meth:`batch_sum` / :meth:`batch_max`). ValueError on every rank when the batch has no
        rewards or group ids."""
        missing = [n for n in ("rewards", "group_ids") if self._codes[FIELDS.index(n)] < 0]
        if missing:
            raise ValueError(f"the batch's advantages need TrainBatch.{' and '.join(missing)} (not set)")
        whole = [self._broadcast(getattr(batch, n) if collective.is_main() else None, n) for n in ("rewards", "group_ids")]
        rows = torch.tensor(share_rows(self._batch_size, self.mini_batches, self.dp_rank, self.dp_size), dtype=torch.long)
        return whole[0], whole[1], Share(rows=rows, sum=self.batch_sum, max=self.batch_max)

    def _broadcast(self, t: Optional[torch.Tensor], name: str) -> torch.Tensor:
        out = collective.broadcast_tensor(t, (self._batch_size,), DTYPES[self._codes[FIELDS.index(name)]])
        if collective.is_main():
            self.sent += nbytes(out) * (collective.world() - 1)
        else:
            self.received += nbytes(out)
        return out

    def batch_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``t`` over the DP ranks, on every rank: each DP rank's value once
        (its model-parallel peers, which hold the same share, add 0)."""
        return self._all_reduce(t if self.counted else torch.zeros_like(t), collective.all_reduce_sum)

    def batch_max(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``t`` over the DP ranks, on every rank."""
        return self._all_reduce(t, collective.all_reduce_max)

    def _all_reduce(self, t: torch.Tensor, reduce) -> torch.Tensor:
        if collective.world() > 1:
            self.sent += nbytes(t)
            self.received += nbytes(t)
        return reduce(t.clone())
