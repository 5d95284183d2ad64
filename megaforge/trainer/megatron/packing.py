"""Pack right-padded rows into one ``thd`` sequence (no padding waste) and unpack per-token values.

Rows b = 0..B-1 of length L_b are laid end to end. With context parallelism c > 1 each row is
padded to P_b = ceil(L_b / 2c) * 2c (megatron/TE's load-balanced layout: CP rank r keeps chunks r and
2c-1-r of each row); the last row's padding then grows until the packed length is a multiple of
c * TP under sequence parallelism (times 16 for FP8 GEMMs). Padding sits after a row's real
tokens, so causal attention keeps it out of every real token's context.

Predictions are *next-token*: position j of the packed sequence predicts token j+1 of the same
row (``labels``). :meth:`Packed.to_rows` maps a per-position value v_j (e.g. the logprob of the
label at j) back to the token-aligned [B, T] layout of :class:`megaforge.types.TrainBatch`:
out[b, t] = v[start_b + t - 1] for 1 <= t < L_b, 0 elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megaforge.trainer.megatron.layers import DOCUMENTS_FORMAT, cp_chunk_positions


@dataclass
class Packed:
    tokens: torch.Tensor  # [1, t_local] this CP rank's tokens
    labels: torch.Tensor  # [1, t_local] next-token labels (0 where there is none)
    position_ids: torch.Tensor  # [1, t_local] position inside the row
    packed_seq_params: object  # megatron PackedSeqParams (thd)
    local_pos: torch.Tensor  # [t_local] global packed positions of this rank's tokens (on the host without CP)
    all_pos: torch.Tensor  # [c * t_local] global positions of the rank-major CP gather (on the host without CP)
    src: torch.Tensor  # [B, T] packed position predicting token (b, t) (0 where invalid)
    valid: torch.Tensor  # [B, T] bool: 1 <= t < L_b
    total: int  # padded global packed length
    # [t_local, layers, K] this rank's tokens' recorded routed experts (-1: none; padding, a row's last
    # token), from TrainBatch.routed_experts; None without (megaforge.trainer.megatron.routing_replay)
    routes: Optional[torch.Tensor] = None
    cp_size: int = 1  # context-parallel ranks the sequence is split over (1: local_pos = all_pos = 0..total-1)

    def to_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """[c * t_local] values in rank-major CP-gather order -> token-aligned [B, T] (differentiable).
        Without CP the gather order is the packed order (``all_pos`` is 0..total-1): no permutation."""
        glob = gathered if self.cp_size == 1 else gathered.index_select(0, self.packed_order())  # [total] packed order
        out = glob.index_select(0, self.src.reshape(-1)).reshape(self.src.shape)
        return torch.where(self.valid, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def packed_order(self) -> torch.Tensor:
        """[total] index into the rank-major CP gather of each packed position (the inverse of ``all_pos``)."""
        inv = torch.empty_like(self.all_pos)
        inv[self.all_pos] = torch.arange(self.all_pos.numel(), device=self.all_pos.device)
        return inv


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor -> ``device``. To CUDA through pinned memory, non-blocking: a copy from pageable
    memory synchronizes the stream first, which would make the GPU wait for the host's packing."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def padded_lengths(lens: list[int], cp_size: int = 1, tp_sp: int = 1, multiple: int = 1) -> list[int]:
    """Each row's length in the packed sequence (see the module doc): rounded up to 2c under
    context parallelism c > 1, the last row grown until the total is a multiple of
    c * tp_sp * multiple."""
    align = 2 * cp_size if cp_size > 1 else 1
    padded = [-(-n // align) * align for n in lens]
    while sum(padded) % (cp_size * tp_sp * multiple):
        padded[-1] += align
    return padded


def max_seqlen_bucket(n: int, align: int = 1) -> int:
    """The ``max_seqlen`` given to attention for a longest row of ``n`` tokens: the smallest
    ``align * 2**k >= n``. An upper bound is all attention needs; a few distinct values keep
    Transformer Engine from re-running its backend selection (its cache holds the last
    parameters only) and building a new cuDNN graph whenever the longest row changes, and keep
    megatron's RoPE table cache small."""
    m = align
    while m < n:
        m *= 2
    return m


def pack(tokens: torch.Tensor, lengths: torch.Tensor, cp_size: int = 1, cp_rank: int = 0, tp_sp: int = 1,
         device=None, cp_group=None, multiple: int = 1, host_cu_seqlens: bool = False,
         routes: Optional[torch.Tensor] = None, documents: bool = False) -> Packed:
    """Pack ``tokens`` [B, T] (right-padded, ``lengths`` [B]) for one CP rank.

    ``tp_sp`` is the TP size when sequence parallelism is on, else 1; each rank's share of the
    packed length is also made a multiple of ``multiple`` (FP8 GEMMs need 16).
    ``host_cu_seqlens``: the PackedSeqParams' cu_seqlens stay on the host. For the ``torch`` layer
    spec: megatron's unfused thd RoPE reads the lengths with ``.tolist()`` in every layer, a device
    sync each time they live on the GPU; Transformer Engine's kernels need them on the device.
    ``documents`` (the torch spec's model with :class:`~megaforge.trainer.megatron.layers.DocumentRotary`,
    no CP): the params' format is :data:`~megaforge.trainer.megatron.layers.DOCUMENTS_FORMAT` and
    ``rope_positions`` [t] (each token's position in its padded document) go with them.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if documents and cp_size > 1:
        raise ValueError("pack(documents=True) is for one CP rank (context parallelism keeps the thd format)")
    B, T = tokens.shape
    if lengths.shape != (B,):
        raise ValueError(f"lengths has shape {tuple(lengths.shape)}, tokens {tuple(tokens.shape)}")
    lens = [int(x) for x in lengths.tolist()]
    if min(lens) < 1 or max(lens) > T:
        raise ValueError(f"lengths must be in [1, {T}] (tokens {tuple(tokens.shape)}), got {lens}")
    padded = padded_lengths(lens, cp_size, tp_sp, multiple)
    total = sum(padded)
    starts = [0]
    for p in padded[:-1]:
        starts.append(starts[-1] + p)
    flat = torch.zeros(total, dtype=torch.long)
    labels = torch.zeros(total, dtype=torch.long)
    pos = torch.zeros(total, dtype=torch.long)
    src = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, (s, n, p) in enumerate(zip(starts, lens, padded)):
        row = tokens[b, :n].long()
        flat[s:s + n] = row
        labels[s:s + n - 1] = row[1:]
        pos[s:s + p] = torch.arange(p)
        src[b, 1:n] = torch.arange(s, s + n - 1)
        valid[b, 1:n] = True
    flat_routes = None
    if routes is not None:
        if tuple(routes.shape[:2]) != (B, T) or routes.dim() != 4:
            raise ValueError(f"routed_experts has shape {tuple(routes.shape)}, expected [{B}, {T}, layers, topk]")
        flat_routes = torch.full((total, *routes.shape[2:]), -1, dtype=routes.dtype)
        for b, (s, n) in enumerate(zip(starts, lens)):
            flat_routes[s:s + n] = routes[b, :n]

    def positions(rank):
        return torch.cat([s + cp_chunk_positions(p, cp_size, rank) for s, p in zip(starts, padded)])

    local_pos = positions(cp_rank)
    all_pos = torch.cat([positions(r) for r in range(cp_size)]) if cp_size > 1 else local_pos
    # TE semantics: cu_seqlens = cumulative real lengths, cu_seqlens_padded = row offsets
    cu_real = torch.cumsum(torch.tensor([0] + lens, dtype=torch.int32), 0, dtype=torch.int32)
    cu_pad = torch.cumsum(torch.tensor([0] + padded, dtype=torch.int32), 0, dtype=torch.int32)
    d = lambda t: to_device(t, device)  # noqa: E731

    def mine(t):
        """[total] -> [1, t_local] at this rank's positions. Without CP that is all of them: no
        gather on the host (its threaded index kernel was seen taking 16 ms on the H200's host)."""
        return (t if cp_size == 1 else t[local_pos])[None]

    if not host_cu_seqlens:
        cu_real, cu_pad = d(cu_real), d(cu_pad)
    if cp_size == 1 and padded == lens:
        # no padding between (or after) the rows: the padded offsets are the *same tensor* as the real ones.
        # Transformer Engine 2.20's DotProductAttention reads that identity as pad_between_seqs False (no device
        # sync); another tensor, equal values or not, counts as padding, which rules out the FlashAttention 2/3/4
        # and unfused backends for thd. (Its zero-fills of O and dQ/dK/dV are fast_zero_fill's, on either way.)
        cu_pad = cu_real
    max_len = max_seqlen_bucket(max(padded), 2 * cp_size if cp_size > 1 else 1)
    params = PackedSeqParams(
        qkv_format=DOCUMENTS_FORMAT if documents else "thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max_len, max_seqlen_kv=max_len, cp_group=cp_group,
    )
    params.cu_seqlens_padded_list = starts + [total]  # cu_pad on the host: attention needs no device sync
    position_ids = d(mine(pos))
    if documents:
        params.rope_positions = position_ids[0]
    return Packed(
        tokens=d(mine(flat)), labels=d(mine(labels)), position_ids=position_ids,
        packed_seq_params=params, src=d(src), valid=d(valid), total=total, cp_size=cp_size,
        # without CP nothing on the device reads them (to_rows needs no permutation): no copies
        local_pos=local_pos if cp_size == 1 else d(local_pos), all_pos=all_pos if cp_size == 1 else d(all_pos),
        routes=None if flat_routes is None else d(mine(flat_routes)[0]),
    )
