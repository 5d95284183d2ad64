"""Loss aggregation over the *global* batch, split into micro-batches and data-parallel ranks.

Each: ``fn(per_token [B, T], mask [B, T], num_tokens, num_seqs, norm) -> scalar`` where
``num_tokens`` / ``num_seqs`` count the trained tokens / sequences of the global batch. Every mode is
a sum over the micro-batch divided by a global constant, so the micro-batch losses add up exactly to
the loss of the whole batch, whatever the split:

* token_mean:              sum_{i,t} l_it m_it / sum_{i,t} m_it
* seq_mean_token_sum:      (1/N) sum_i sum_t l_it m_it
* seq_mean_token_mean:     (1/N) sum_i [sum_t l_it m_it / sum_t m_it]
* seq_mean_token_sum_norm: (1/N) sum_i sum_t l_it m_it / norm   (Dr. GRPO's constant, e.g. max length)
"""
from __future__ import annotations

import torch

from megaforge.algorithms.core import LOSS_AGGS


@LOSS_AGGS.register("token_mean")
def agg_token_mean(x, mask, num_tokens: int, num_seqs: int, norm: float):
    return (x * mask).sum() / max(num_tokens, 1)


@LOSS_AGGS.register("seq_mean_token_sum")
def agg_seq_mean_token_sum(x, mask, num_tokens: int, num_seqs: int, norm: float):
    return (x * mask).sum() / max(num_seqs, 1)


@LOSS_AGGS.register("seq_mean_token_mean")
def agg_seq_mean_token_mean(x, mask, num_tokens: int, num_seqs: int, norm: float):
    per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    return per_seq.sum() / max(num_seqs, 1)


@LOSS_AGGS.register("seq_mean_token_sum_norm")
def agg_seq_mean_token_sum_norm(x, mask, num_tokens: int, num_seqs: int, norm: float):
    if norm <= 0:
        raise ValueError("seq_mean_token_sum_norm needs a positive normaliser (algo.loss_agg_norm)")
    return (x * mask).sum() / (max(num_seqs, 1) * norm)


def aggregate(x, mask, mode: str, num_tokens: int, num_seqs: int, norm: float = 0.0) -> torch.Tensor:
    return LOSS_AGGS.get(mode)(x, mask, num_tokens, num_seqs, norm)
