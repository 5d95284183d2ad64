"""Packing right-padded rows into fewer rows of several documents (the torch backend's SFT packing).

A packed row holds whole documents back to back; ``position_ids`` restart at 0 for every document
(and for the padding tail, which forms its own segment). Given ``position_ids`` and no attention
mask, transformers builds a block-diagonal causal mask from the restarts (``find_packed_sequence_
indices``), so no token attends across documents and the logits of each document equal its
unpacked ones. Token-aligned per-token values of the packed rows map back with :meth:`Packing.unpack`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def plan_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: lists of row indices whose lengths add up to at most ``capacity``.
    Bins keep ascending row order inside; every length must be <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"row {i} has {n} tokens > packing capacity {capacity}")
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return [sorted(b) for b in bins]


@dataclass
class Packing:
    tokens: torch.Tensor  # [R, L] long
    position_ids: torch.Tensor  # [R, L] long, restarting at 0 per document
    src_row: torch.Tensor  # [R, L] long: the unpacked row of each position (-1: padding)
    src_col: torch.Tensor  # [R, L] long: its column in that row
    shape: tuple[int, int]  # (B, T) of the unpacked batch

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token values [R, L] of the packed rows -> [B, T] of the unpacked rows (0 elsewhere)."""
        out = torch.zeros(self.shape, dtype=x.dtype, device=x.device)
        real = self.src_row >= 0
        rows, cols = self.src_row[real].to(x.device), self.src_col[real].to(x.device)
        out[rows, cols] = x[real.to(x.device)]
        return out


def pack_rows(tokens: torch.Tensor, lengths: torch.Tensor, capacity: int = 0, pad_id: int = 0) -> Packing:
    """Pack the rows ``tokens[b, :lengths[b]]`` into rows of ``capacity`` tokens (0: the longest row,
    so packing only removes padding and never lengthens a row)."""
    B, T = tokens.shape
    lens = [int(n) for n in lengths.tolist()]
    cap = capacity or (max(lens) if lens else 0)
    bins = plan_bins(lens, cap)
    L = max(sum(lens[i] for i in b) for b in bins) if bins else 0
    R = len(bins)
    out_tok = torch.full((R, L), pad_id, dtype=tokens.dtype)
    pos = torch.zeros((R, L), dtype=torch.long)
    src_row = torch.full((R, L), -1, dtype=torch.long)
    src_col = torch.zeros((R, L), dtype=torch.long)
    for r, b in enumerate(bins):
        at = 0
        for i in b:
            n = lens[i]
            out_tok[r, at:at + n] = tokens[i, :n].cpu()
            pos[r, at:at + n] = torch.arange(n)
            src_row[r, at:at + n] = i
            src_col[r, at:at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(L - at)  # the padding tail is a segment of its own
    return Packing(out_tok, pos, src_row, src_col, (B, T))
