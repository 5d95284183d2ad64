"""Token-aligned logprobs and entropy from logits (the torch backend's and the tests' oracle).

For logits [B, T, V] of tokens [B, T] (position t predicts token t + 1), temperature tau:

    logprobs[:, t] = log_softmax(logits[:, t - 1] / tau)[tokens[:, t]]   for 1 <= t < length
    entropy[:, t]  = H(softmax(logits[:, t - 1] / tau))                  (same positions)

and 0 at t = 0 and on padding (t >= length).
"""
from __future__ import annotations

import torch


def valid_positions(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] float mask of positions 1 <= t < length."""
    t = torch.arange(T, device=lengths.device)[None, :]
    return ((t >= 1) & (t < lengths[:, None])).float()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False):
    """(logprobs [B, T], entropy [B, T] or None), token-aligned, float32."""
    B, T = tokens.shape
    z = logits[:, :-1, :].float()
    if temperature != 1.0:
        z = z / temperature
    logz = torch.logsumexp(z, dim=-1)  # [B, T-1]
    picked = z.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    lp = picked - logz
    valid = valid_positions(lengths.to(tokens.device), T)
    out = torch.zeros((B, T), dtype=torch.float32, device=logits.device)
    out[:, 1:] = lp
    out = out * valid
    ent = None
    if with_entropy:
        p = torch.softmax(z, dim=-1)
        h = logz - (p * z).sum(-1)
        ent = torch.zeros_like(out)
        ent[:, 1:] = h
        ent = ent * valid
    return out, ent
