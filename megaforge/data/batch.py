"""Turning samples (RL) or prompt/response rows (SFT) into a right-padded, token-aligned TrainBatch,
and the rows of a batch one data-parallel rank trains (its *share*, :func:`share_of`)."""
from __future__ import annotations

from typing import Sequence

import torch

from megaforge.types import MiniBatchPart, Sample, TrainBatch


def samples_to_batch(samples: Sequence[Sample], pad_id: int) -> TrainBatch:
    """tokens = prompt + response; loss_mask / rollout_logprobs set on response tokens only
    (and only where ``response_mask`` is 1, so tool outputs are never trained). Advantages are 0
    here; the loop fills them in."""
    if not samples:
        raise ValueError("samples_to_batch: no samples")
    B = len(samples)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    T = max(lengths)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T))
    rlp = torch.zeros((B, T))
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[b, :p] = torch.tensor(s.prompt_ids, dtype=torch.long)
        if r:
            tokens[b, p:p + r] = torch.tensor(s.response_ids, dtype=torch.long)
            m = torch.tensor(s.response_mask, dtype=torch.float32)
            mask[b, p:p + r] = m
            rlp[b, p:p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32) * m
    batch = TrainBatch(
        tokens=tokens, lengths=torch.tensor(lengths, dtype=torch.long), loss_mask=mask,
        advantages=torch.zeros((B, T)), rollout_logprobs=rlp,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        weight_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
        routed_experts=routing_table(samples, lengths, T),
    )
    return set_denominators(batch)


def routing_table(samples: Sequence[Sample], lengths: list[int], T: int):
    """[B, T, layers, topk] of the samples' routed experts (row b: its [L_b - 1, layers, topk] table at
    t < L_b - 1, -1 elsewhere), in their dtype; None when no sample has one. All or none must have one,
    of one [layers, topk]: the engine boundary (megaforge.rollout.routing.check) made them so."""
    have = [s.routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"samples_to_batch: {have.count(False)} of {len(samples)} samples have no routed experts")
    dims = {tuple(s.routed_experts.shape[1:]) for s in samples}
    if len(dims) != 1:
        raise ValueError(f"samples_to_batch: routed experts of different [layers, topk]: {sorted(dims)}")
    out = torch.full((len(samples), T, *dims.pop()), -1, dtype=samples[0].routed_experts.dtype)
    for b, (s, n) in enumerate(zip(samples, lengths)):
        if s.routed_experts.shape[0] != n - 1:
            raise ValueError(f"samples_to_batch: sample {b} (group {s.group_id}) has routed experts for "
                             f"{s.routed_experts.shape[0]} tokens, {n - 1} expected (prompt + response - 1)")
        out[b, :n - 1] = s.routed_experts
    return out


def set_denominators(batch: TrainBatch) -> TrainBatch:
    batch.num_tokens = int(batch.loss_mask.sum())
    batch.num_seqs = int((batch.loss_mask.sum(-1) > 0).sum())
    return batch


def sft_batch(rows, eos_id: int, pad_id: int, max_len: int) -> TrainBatch:
    """prompt + response + eos per row; the loss covers response and eos. Chat rows (``sft_ids``)
    come whole with their own mask (assistant turns, each ending with its end-of-turn token). Rows
    longer than ``max_len`` are cut (the cut part is not trained)."""
    seqs, masks = [], []
    for r in rows:
        if getattr(r, "sft_ids", None) is not None:
            seqs.append(list(r.sft_ids)[:max_len])
            masks.append(list(r.sft_mask)[:max_len])
            continue
        resp = list(r.response_ids) + [eos_id]
        ids = list(r.prompt_ids) + resp
        m = [0] * len(r.prompt_ids) + [1] * len(resp)
        seqs.append(ids[:max_len])
        masks.append(m[:max_len])
    B, T = len(seqs), max(len(s) for s in seqs)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T))
    for b, (s, m) in enumerate(zip(seqs, masks)):
        tokens[b, :len(s)] = torch.tensor(s)
        mask[b, :len(m)] = torch.tensor(m, dtype=torch.float32)
    batch = TrainBatch(tokens=tokens, lengths=torch.tensor([len(s) for s in seqs]), loss_mask=mask,
                       advantages=torch.zeros((B, T)), rollout_logprobs=torch.zeros((B, T)))
    return set_denominators(batch)


# ------------------------------------------------------------------ data-parallel shares of a batch
def shard_range(n: int, k: int, parts: int) -> tuple[int, int]:
    """Contiguous rows [lo, hi) of ``n`` that part ``k`` of ``parts`` owns (sizes differ by at most 1,
    the larger first). :func:`megaforge.collective.shard_range` is this for ranks."""
    base, extra = divmod(n, parts)
    lo = k * base + min(k, extra)
    return lo, lo + base + (1 if k < extra else 0)


def mini_batch_ranges(n: int, mini_batches: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of each of the ``mini_batches`` contiguous mini-batches of a batch of ``n`` rows
    (sizes differ by at most one)."""
    if mini_batches > n:
        raise ValueError(f"trainer.mini_batches={mini_batches} exceeds the batch of {n} sequences")
    return [shard_range(n, k, mini_batches) for k in range(mini_batches)]


def share_rows(n: int, mini_batches: int, dp_rank: int, dp_size: int) -> list[int]:
    """Rows of a batch of ``n`` that DP rank ``dp_rank`` of ``dp_size`` trains, in order: of every
    mini-batch (:func:`mini_batch_ranges`) its contiguous part ``shard_range(size, dp_rank, dp_size)``.
    ValueError when a mini-batch has fewer rows than there are DP ranks."""
    rows: list[int] = []
    for lo, hi in mini_batch_ranges(n, mini_batches):
        if hi - lo < dp_size:
            raise ValueError(
                f"a mini-batch of {hi - lo} sequences cannot feed {dp_size} data-parallel ranks: raise "
                "rollout.batch_size * grpo.n_samples or lower trainer.mini_batches")
        a, b = shard_range(hi - lo, dp_rank, dp_size)
        rows.extend(range(lo + a, lo + b))
    return rows


def share_of(batch: TrainBatch, mini_batches: int, dp_rank: int, dp_size: int) -> TrainBatch:
    """DP rank ``dp_rank``'s share of the whole ``batch``: its :func:`share_rows` (trimmed to their
    longest row) with :attr:`~TrainBatch.minis` (per mini-batch: the share's rows of it and the whole
    mini-batch's row, token and sequence counts) and ``num_tokens`` / ``num_seqs`` of the whole batch."""
    rows = share_rows(batch.batch_size, mini_batches, dp_rank, dp_size)
    parts, lo = [], 0
    for a, b in mini_batch_ranges(batch.batch_size, mini_batches):
        n = shard_range(b - a, dp_rank, dp_size)
        mask = batch.loss_mask[a:b]
        parts.append(MiniBatchPart(lo, lo + n[1] - n[0], b - a, int(mask.sum()), int((mask.sum(-1) > 0).sum())))
        lo = parts[-1].hi
    share = batch.select(rows)
    share.num_tokens, share.num_seqs, share.minis = batch.num_tokens, batch.num_seqs, tuple(parts)
    return share


def share_after_first_mini(share: TrainBatch) -> TrainBatch:
    """The share's rows of its mini-batches 2..M, as a share of those M - 1 mini-batches (rows
    renumbered from 0; trimmed to their longest row)."""
    first = share.minis[0]
    rest = share.select(slice(first.hi, share.batch_size))
    rest.minis = tuple(MiniBatchPart(p.lo - first.hi, p.hi - first.hi, p.size, p.num_tokens, p.num_seqs)
                       for p in share.minis[1:])
    return rest


def share_mini_batches(share: TrainBatch) -> list[TrainBatch]:
    """The share's rows of every mini-batch (trimmed), each with the whole mini-batch's
    ``num_tokens`` / ``num_seqs`` (what the loss of its rows divides by): a whole batch again."""
    out = []
    for p in share.minis:
        rows = share.select(slice(p.lo, p.hi))
        rows.num_tokens, rows.num_seqs = p.num_tokens, p.num_seqs
        out.append(rows)
    return out


def token_budget_runs(lengths: Sequence[int], max_rows: int, max_tokens: int = 0,
                      padded: bool = False) -> list[tuple[int, int]]:
    """Consecutive micro-batches [lo, hi) of rows with these ``lengths``, cut greedily in order: a run
    takes the next row while ``hi - lo <= max_rows`` and its positions stay <= ``max_tokens``.
    Positions of a run: ``sum(lengths[lo:hi])`` (rows packed end to end: the Megatron backend's thd
    micro-batch), or with ``padded`` ``(hi - lo) * max(lengths[lo:hi])`` (rows padded to the run's
    longest: the torch backend, which sorts rows longest first before cutting). A row longer than
    ``max_tokens`` is a run of its own. ``max_tokens`` 0: runs of ``max_rows`` rows.
    E.g. lengths [300, 500, 200, 900, 100], max_rows 8, max_tokens 1000 -> [(0, 3), (3, 5)];
    with padded -> [(0, 2), (2, 3), (3, 4), (4, 5)]."""
    if max_rows < 1 or max_tokens < 0:
        raise ValueError(f"micro-batch limits must be positive: rows {max_rows}, tokens {max_tokens}")
    runs: list[tuple[int, int]] = []
    lo, total, longest = 0, 0, 0
    for i, n in enumerate(lengths):
        cost = (i - lo + 1) * max(longest, n) if padded else total + n
        if i > lo and (i - lo >= max_rows or (max_tokens and cost > max_tokens)):
            runs.append((lo, i))
            lo, total, longest = i, 0, 0
        total, longest = total + n, max(longest, n)
    if len(lengths) > lo:
        runs.append((lo, len(lengths)))
    return runs


def per_token_bytes(batch: TrainBatch) -> int:
    """Bytes of the batch's per-token ([B, T]) tensors (host memory when they live on the host)."""
    return sum(t.numel() * t.element_size() for name in TrainBatch.TENSOR_FIELDS if name not in TrainBatch.ROW_FIELDS
               and (t := getattr(batch, name)) is not None)
