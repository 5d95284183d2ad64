"""Token sampling with the logprob of each sampled token under the distribution actually used.

For one decoding step with logits ``z`` [B, V] and per-row temperature ``T`` [B], top-k ``k`` [B]
(<= 0: off) and top-p ``p`` [B]:

    q = softmax(z / T)  restricted to the top-k tokens and to the smallest prefix of tokens (sorted by
        probability) whose mass reaches p, then renormalised
    token ~ q,   logprob = log q[token]

``T == 0`` means greedy: token = argmax z, logprob = log softmax(z)[token].
"""
from __future__ import annotations

from typing import Optional

import torch


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Scaled and truncated logits [B, V] (float32); removed tokens are -inf."""
    z = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    z = z / t[:, None]
    V = z.shape[-1]
    need_k = bool(((top_k > 0) & (top_k < V)).any())
    need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return z
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    remove = torch.zeros_like(sorted_z, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
        ranks = torch.arange(V, device=z.device)[None, :]
        remove |= ranks >= k[:, None]
    if need_p:
        probs = torch.softmax(sorted_z.masked_fill(remove, float("-inf")), dim=-1)
        cum = probs.cumsum(-1)
        # drop a token when the mass before it already reaches p (always keeps the first token)
        remove |= (cum - probs) >= top_p[:, None].float()
    sorted_z = sorted_z.masked_fill(remove, float("-inf"))
    return torch.empty_like(z).scatter_(-1, order, sorted_z)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) for one decoding step; see the module docstring."""
    z = process_logits(logits, temperature, top_k, top_p)
    logq = torch.log_softmax(z, dim=-1)
    greedy = temperature <= 0
    if bool(greedy.all()):
        tok = logits.argmax(-1)
    else:
        probs = logq.exp()
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        if bool(greedy.any()):
            tok = torch.where(greedy, logits.argmax(-1), tok)
    lp = logq.gather(-1, tok[:, None]).squeeze(-1)
    if bool(greedy.any()):
        lp_greedy = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        lp = torch.where(greedy, lp_greedy, lp)
    return tok, lp
