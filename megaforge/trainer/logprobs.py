"""Token-aligned logprobs and entropy from logits (the torch backend's and the tests' oracle).

For logits [B, T, V] of tokens [B, T] (position t predicts token t + 1), temperature tau:

    logprobs[:, t] = log_softmax(logits[:, t - 1] / tau)[tokens[:, t]]   for 1 <= t < length
    entropy[:, t]  = H(softmax(logits[:, t - 1] / tau))                  (same positions)

and 0 at t = 0 and on padding (t >= length).

:func:`token_logprobs` takes the logits of every position; :func:`selected_token_logprobs` takes
the logits [N, V] of the positions :func:`trained_positions` lists (the tokens a loss trains), and
gives the same values there and 0 at every other position.
"""
from __future__ import annotations

import torch


def valid_positions(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] float mask of positions 1 <= t < length."""
    t = torch.arange(T, device=lengths.device)[None, :]
    return ((t >= 1) & (t < lengths[:, None])).float()


def _logprob_entropy(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """z [..., V] float32 (temperature applied), targets [...] -> (log_softmax(z)[target] [...],
    entropy H = logsumexp(z) - sum softmax(z) z [...] or None)."""
    logz = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets[..., None]).squeeze(-1) - logz
    if not with_entropy:
        return lp, None
    return lp, logz - (torch.softmax(z, dim=-1) * z).sum(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False):
    """(logprobs [B, T], entropy [B, T] or None), token-aligned, float32, at every position
    1 <= t < length."""
    B, T = tokens.shape
    z = logits[:, :-1, :].float()
    if temperature != 1.0:
        z = z / temperature
    lp, h = _logprob_entropy(z, tokens[:, 1:], with_entropy)
    valid = valid_positions(lengths.to(tokens.device), T)
    out = torch.zeros((B, T), dtype=torch.float32, device=logits.device)
    out[:, 1:] = lp
    out = out * valid
    ent = None
    if with_entropy:
        ent = torch.zeros_like(out)
        ent[:, 1:] = h
        ent = ent * valid
    return out, ent


def trained_positions(loss_mask: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N], cols [N]) of the token positions (b, t) with loss_mask[b, t] > 0 and 1 <= t < length,
    row-major; their logits are the hidden states at (b, t - 1)."""
    keep = (loss_mask > 0) & valid_positions(lengths.to(loss_mask.device), loss_mask.shape[1]).bool()
    rows, cols = keep.nonzero(as_tuple=True)
    return rows, cols


def selected_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                            temperature: float = 1.0, with_entropy: bool = False):
    """(logprobs [B, T], entropy [B, T] or None), float32, from ``logits`` [N, V] = the logits at
    positions (rows, cols - 1), i.e. predicting tokens[rows, cols]: the values of
    :func:`token_logprobs` at (rows, cols), 0 everywhere else (no gradient there)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lp, h = _logprob_entropy(z, tokens[rows, cols], with_entropy)
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device).index_put((rows, cols), lp)
    ent = None
    if with_entropy:
        ent = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device).index_put((rows, cols), h)
    return out, ent
