"""The batch hand-off: the main rank builds each step's whole TrainBatch; every rank receives its
data-parallel *share* (:func:`megaforge.data.batch.share_of`) as tensors, point to point.

    main rank                                         rank r (r != 0), of DP rank d
      error or None          -- broadcast (tiny) -->    every rank stops together on a bad batch
      for every DP rank d: share_of(batch, m, d, DP)
      header [4 + F + 4 m] int64  -- send -->           counts, share shape, dtypes, mini-batch layout
      each tensor field that is set -- send -->         the share's tensors

Header: the whole batch's ``num_tokens`` and ``num_seqs``, the share's rows ``n`` and columns ``T``, one
dtype code per tensor field (F of them; -1: not set), then per mini-batch (m = ``trainer.mini_batches``)
the share's rows of it, the mini-batch's rows, ``num_tokens`` and ``num_seqs``. Model-parallel peers of
one DP rank (megatron's TP / CP / PP ranks) receive the same share. A rank thus receives
``8 (4 + F + 4 m) + n (T * s_tok + s_row)`` bytes, with ``s_tok`` / ``s_row`` the element bytes of the
per-token / per-row fields set: about 1/DP of the batch.

Per-token results (reference / old log-probs, values) stay on their rank. When the advantages need
them (``algo.kl_in_reward``'s penalty, critic values: estimators that normalise over groups and the
whole batch), :meth:`BatchHandOff.gather` brings those [n, T] tensors of one rank per DP rank to the
main rank, which computes the whole batch's advantages with the same arithmetic on the same tensors
as a single process, and :meth:`BatchHandOff.scatter` sends every rank its rows of the results.
Every method is collective over the world. Byte counts: :attr:`BatchHandOff.received` /
:attr:`BatchHandOff.sent` (tensors only, headers included, since the last :meth:`BatchHandOff.share`).
"""
from __future__ import annotations

from typing import Optional

import torch

from megaforge import collective
from megaforge.data.batch import share_of, share_rows
from megaforge.types import MiniBatchPart, TrainBatch

FIELDS = TrainBatch.TENSOR_FIELDS
#: the dtypes a handed-off tensor may have (its header code is the index)
DTYPES = (torch.int64, torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.float16, torch.bool,
          torch.uint8)


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
        self._rows: list[list[int]] = []  # main: the whole batch's rows of every DP rank's share
        self._cols: list[int] = []  # main: the columns of every DP rank's share
        self._whole = (0, 0)  # main: (rows, columns) of the whole batch
        self._local = (0, 0)  # every rank: (rows, columns) of its share

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
        err = collective.broadcast_object(err)
        if err:
            raise ValueError(err)
        if not collective.is_main():
            return self._receive()
        mine = None
        self._whole = (batch.batch_size, int(batch.tokens.shape[1]))
        self._rows, self._cols = [], []
        for d in range(self.dp_size):
            share = share_of(batch, self.mini_batches, d, self.dp_size)
            self._rows.append(share_rows(batch.batch_size, self.mini_batches, d, self.dp_size))
            self._cols.append(int(share.tokens.shape[1]))
            header = self._header(share, codes)
            for r in self._ranks_of(d):
                if r == 0:
                    mine = share
                    continue
                self._send(header, r)
                for name, c in zip(FIELDS, codes):
                    if c >= 0:
                        self._send(getattr(share, name), r)
        self._local = (mine.batch_size, int(mine.tokens.shape[1]))
        return mine

    @staticmethod
    def _header(share: TrainBatch, codes: list[int]) -> torch.Tensor:
        h = [share.num_tokens, share.num_seqs, share.batch_size, int(share.tokens.shape[1]), *codes]
        for p in share.minis:
            h += [p.hi - p.lo, p.size, p.num_tokens, p.num_seqs]
        return torch.tensor(h, dtype=torch.long)

    def _receive(self) -> TrainBatch:
        h = self._recv((4 + len(FIELDS) + 4 * self.mini_batches,), torch.long).tolist()
        num_tokens, num_seqs, n, T = h[:4]
        codes, rest = h[4:4 + len(FIELDS)], h[4 + len(FIELDS):]
        minis, lo = [], 0
        for k in range(self.mini_batches):
            count, size, ntok, nseq = rest[4 * k:4 * k + 4]
            minis.append(MiniBatchPart(lo, lo + count, size, ntok, nseq))
            lo += count
        fields = {name: (None if c < 0 else self._recv((n,) if name in TrainBatch.ROW_FIELDS else (n, T), DTYPES[c]))
                  for name, c in zip(FIELDS, codes)}
        self._local = (n, T)
        return TrainBatch(**fields, num_tokens=num_tokens, num_seqs=num_seqs, minis=tuple(minis))

    # ------------------------------------------------------------------ per-token values, both ways
    def gather(self, tensors: dict[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        """Per-token ``tensors`` [n, T] of this rank's share -> the whole batch's [B, T] on the main
        rank (0 beyond each share's columns), None elsewhere. One rank per DP rank sends; every rank
        passes the same names and dtypes."""
        names = sorted(tensors)
        for name in names:
            if tuple(tensors[name].shape) != self._local:
                raise ValueError(f"gather {name}: shape {tuple(tensors[name].shape)}, the share is {self._local}")
        if not collective.is_main():
            if self._ranks_of(self.dp_rank)[0] == collective.rank():
                for name in names:
                    self._send(tensors[name].cpu(), 0)
            return None
        out = {name: torch.zeros(self._whole, dtype=tensors[name].dtype) for name in names}
        for d in range(self.dp_size):
            src = self._ranks_of(d)[0]
            rows, cols = torch.tensor(self._rows[d], dtype=torch.long), self._cols[d]
            for name in names:
                if src == 0:
                    part = tensors[name].cpu()
                else:
                    part = self._recv((len(rows), cols), tensors[name].dtype, src)
                out[name][rows, :cols] = part
        return out

    def scatter(self, whole: Optional[dict[str, torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
        """The main rank's whole-batch [B, T] tensors ``whole[name]`` -> every rank's rows of them
        [n, T] (its share's; ``whole`` is None on the other ranks)."""
        names = sorted(names)
        codes = collective.broadcast_object([dtype_code(n, whole[n]) for n in names] if collective.is_main() else None)
        if not collective.is_main():
            return {name: self._recv(self._local, DTYPES[c]) for name, c in zip(names, codes)}
        mine = {}
        for d in range(self.dp_size):
            rows, cols = torch.tensor(self._rows[d], dtype=torch.long), self._cols[d]
            parts = {name: whole[name][rows, :cols].contiguous() for name in names}
            for r in self._ranks_of(d):
                if r == 0:
                    mine = parts
                    continue
                for name in names:
                    self._send(parts[name], r)
        return mine
