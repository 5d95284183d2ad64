"""Turning samples (RL) or prompt/response rows (SFT) into a right-padded, token-aligned TrainBatch."""
from __future__ import annotations

from typing import Sequence

import torch

from megaforge.types import Sample, TrainBatch


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
    )
    return set_denominators(batch)


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
