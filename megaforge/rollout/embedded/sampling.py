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


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   need_k: Optional[bool] = None, need_p: Optional[bool] = None) -> torch.Tensor:
    """Scaled and truncated logits [B, V] (float32); removed tokens are -inf.

    ``need_k`` / ``need_p``: whether any row truncates by top-k / top-p; None reads it from the
    tensors (a host sync). Callers that must not sync (CUDA graphs) pass them from the requests.
    """
    z = logits.float()
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    z = z / t[:, None]
    V = z.shape[-1]
    if need_k is None:
        need_k = bool(((top_k > 0) & (top_k < V)).any())
    if need_p is None:
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


_M64 = (1 << 64) - 1


def _to_i64(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _to_i64(0x9E3779B97F4A7C15), _to_i64(0xBF58476D1CE4E5B9), _to_i64(0x94D049BB133111EB)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform number in [0, 1) per row from (seed, position) alone (splitmix64 on int64 with
    wrap-around), float64 [B]. The same request draws the same numbers whatever batch it is in."""
    x = seeds.to(torch.int64) * _GOLDEN + positions.to(torch.int64) + 1
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return ((x >> 11) & ((1 << 53) - 1)).to(torch.float64) * (2.0 ** -53)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    seeds: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) for one decoding step; see the module docstring.

    Rows draw by inverse CDF from a uniform number: ``counter_uniform(seed, position)`` where
    ``seeds[b] >= 0`` (reproducible per request), else ``torch.rand`` with ``generator``.
    """
    greedy = temperature <= 0
    mode = "all" if bool(greedy.all()) else ("some" if bool(greedy.any()) else "none")
    u = None
    if mode != "all":
        B = logits.shape[0]
        u = torch.rand(B, generator=generator, device=logits.device, dtype=torch.float64)
        if seeds is not None:
            seeded = seeds >= 0
            if bool(seeded.any()):
                u = torch.where(seeded, counter_uniform(seeds, positions), u)
    V = logits.shape[-1]
    need_k = bool(((top_k > 0) & (top_k < V)).any())
    need_p = bool((top_p < 1.0).any())
    return sample_from_uniform(logits, temperature, top_k, top_p, u, need_k, need_p, mode)


def sample_from_uniform(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: Optional[torch.Tensor],
    need_k: bool,
    need_p: bool,
    greedy: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` with no host synchronisation (safe inside a CUDA graph).

    logits [B, V]; temperature, top_p float [B]; top_k long [B]; u float64 [B] in [0, 1) (unused
    when every row is greedy). The caller fixes the stages: ``need_k`` / ``need_p`` (any row
    truncates) and ``greedy``: "all" | "some" | "none" (rows with temperature <= 0).
    Returns (tokens long [B], logprobs float32 [B]).
    """
    z = process_logits(logits, temperature, top_k, top_p, need_k=need_k, need_p=need_p)
    logq = torch.log_softmax(z, dim=-1)
    is_greedy = temperature <= 0
    if greedy == "all":
        tok = logits.argmax(-1)
    else:
        cdf = logq.double().exp().cumsum(-1)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)
        if greedy == "some":
            tok = torch.where(is_greedy, logits.argmax(-1), tok)
    lp = logq.gather(-1, tok[:, None]).squeeze(-1)
    if greedy != "none":
        lp_greedy = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        lp = torch.where(is_greedy, lp_greedy, lp)
    return tok, lp
