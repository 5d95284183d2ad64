"""Token sampling with the logprob of each sampled token under the distribution actually used.

For one decoding step with logits ``z`` [B, V] and per-row temperature ``T`` [B], top-k ``k`` [B]
(<= 0: off) and top-p ``p`` [B]:

    q = softmax(z / T)  restricted to the top-k tokens and to the smallest prefix of tokens (sorted by
        probability) whose mass reaches p, then renormalised
    token ~ q,   logprob = log q[token]

``T == 0`` means greedy: token = argmax z, logprob = log softmax(z)[token].

The draw is Gumbel-max: token = argmax_v (z'_v + g_v) with z' the scaled, truncated logits (log q
up to a per-row constant) and g_v iid standard Gumbel, an exact sample from q (Gumbel 1954; Maddison
et al. 2014), computed elementwise (no scan over the vocabulary, no host sync). The noise is
counter-based: g[b, v] is a function of the row's key (:func:`counter_keys` of the request's seed
and token index) and v alone (:func:`gumbel_noise`), so a request draws the same tokens whatever
batch it is in.

Bias bound (the only departure from an exact draw: 64 noise bits per token). Couple each computed
g_v with the exact Gumbel of the real number its 64 bits truncate; every computed score is then
within w_v <= 1.45 (2^-53 + 1/m_v) + 1e-13 of the exact one (m_v: the 62-bit integer behind t, see
gumbel_noise; the 1e-13 covers float64 rounding of the logs and the sum, |score| < 2^7). The token
can differ only when the exact top-two gap is below 2 tau (probability <= e^(2 tau) - 1 for any z:
given the maximum M, the gap is below delta with probability <= (e^delta - 1) e^-M sum_v e^z_v, an
Exp(1) variable's mean) or when some m_v < 1.45 / tau (probability <= 1.45 V 2^-62 / tau). With
tau = sqrt(0.725 V 2^-62): total variation <= 4 tau = 6.2e-7 at V = 151,936 (Qwen), 3.6e-8 at V = 512.
"""
from __future__ import annotations

from typing import Callable, Optional

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


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64, in place on ``x`` (wrap-around products; logical right
    shifts as masked arithmetic ones)."""
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        x ^= (x >> shift) & ((1 << (64 - shift)) - 1)
        if mul is not None:
            x *= mul
    return x


def counter_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The noise key of each row, int64 [B]: splitmix64 of ``seed * golden + position + 1``, from
    (seed, position) alone, so a request draws the same tokens whatever batch it is in."""
    return _mix64(seeds.to(torch.int64) * _GOLDEN + positions.to(torch.int64) + 1)


def vocab_offsets(V: int, device=None) -> torch.Tensor:
    """(v + 1) * golden for v < V, int64 [V] (wrap-around): the splitmix64 stream steps of the tokens.

    A tensor input of the compiled draw, not computed inside it: inductor's CPU code generation
    miscompiled ``arange * constant`` in int64 (a vectorised arange with a 64-bit step: wrong values,
    then heap corruption; torch 2.13), so the compiled code only loads these values."""
    return torch.arange(1, V + 1, device=device, dtype=torch.int64) * _GOLDEN


def gumbel_noise(keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise g [B, V] (float64), element (b, v) a function of (keys[b], v) alone
    (offsets: :func:`vocab_offsets` (V)).

    h = splitmix64(keys[b] + (v + 1) * golden) (the splitmix64 stream of the key, 64 bits); its top
    bit picks a half of the unit interval and its low 62 bits m give t = (m + 1/2) 2^-63 in (0, 1/2]:
    u = t (top bit set) or u = 1 - t, never formed: E = -log(u) = -log t or -log1p(-t) ~ Exp(1), and
    g = -log E. Both halves keep t's relative precision (2^-53 + 1/m) in E (a factor <= 1.45), so
    near u = 1, where the winning tokens' noise lives, E is as fine as near 0. Eager, the work is in
    place: at most 4 [B, V] tensors of 8 bytes live at once.
    """
    h = _mix64(keys.to(torch.int64)[:, None] + offsets[None, :])
    upper = h < 0
    t = (h & ((1 << 62) - 1)).to(torch.float64)
    del h
    t.add_(0.5).mul_(2.0 ** -63)
    e = torch.neg(t).log1p_().neg_()  # -log1p(-t): u = 1 - t
    e = torch.where(upper, t.log_().neg_(), e)  # -log t: u = t
    return e.log_().neg_()


def gumbel_argmax(z: torch.Tensor, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """argmax_v (z[b, v] + g[b, v]) with g = :func:`gumbel_noise` (keys [B], offsets [V]), long [B]: an
    exact draw from softmax(z[b]) (Gumbel-max) up to the noise's discretisation (module docstring:
    bias bound). z [B, V] float (-inf: never drawn); the sum is taken in float64."""
    return gumbel_noise(keys, offsets).add_(z).argmax(-1)


def draw_tokens(z: torch.Tensor, keys: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens long [B], logprobs float32 [B]) of rows z [B, V] (float32 scaled, truncated logits):
    token = :func:`gumbel_argmax` (z, keys, offsets), logprob = log_softmax(z)[token]. Flag-free, so
    one torch.compile graph serves every sampling configuration (the fast path compiles it)."""
    tok = gumbel_argmax(z, keys, offsets)
    return tok, torch.log_softmax(z, dim=-1).gather(-1, tok[:, None]).squeeze(-1)


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

    A row's noise key is ``counter_keys(seed, position)`` where ``seeds[b] >= 0`` (reproducible per
    request), else a random 62-bit key from ``generator``.
    """
    greedy = temperature <= 0
    mode = "all" if bool(greedy.all()) else ("some" if bool(greedy.any()) else "none")
    keys = None
    if mode != "all":
        B = logits.shape[0]
        keys = torch.randint(0, 2 ** 62, (B,), generator=generator, device=logits.device, dtype=torch.int64)
        if seeds is not None:
            seeded = seeds >= 0
            if bool(seeded.any()):
                keys = torch.where(seeded, counter_keys(seeds, positions), keys)
    V = logits.shape[-1]
    need_k = bool(((top_k > 0) & (top_k < V)).any())
    need_p = bool((top_p < 1.0).any())
    return sample_from_keys(logits, temperature, top_k, top_p, keys, need_k, need_p, mode)


def sample_from_keys(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: Optional[torch.Tensor],
    need_k: bool,
    need_p: bool,
    greedy: str,
    draw: Callable = draw_tokens,
    offsets: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` with no host synchronisation (safe inside a CUDA graph).

    logits [B, V]; temperature, top_p float [B]; top_k long [B]; keys int64 [B] (unused when every
    row is greedy). The caller fixes the stages: ``need_k`` / ``need_p`` (any row truncates) and
    ``greedy``: "all" | "some" | "none" (rows with temperature <= 0). ``draw``: :func:`draw_tokens`
    or a compiled form of it; ``offsets``: :func:`vocab_offsets` of the vocabulary (None: made here).
    Returns (tokens long [B], logprobs float32 [B]).
    """
    is_greedy = temperature <= 0
    if greedy == "all":
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
    z = process_logits(logits, temperature, top_k, top_p, need_k=need_k, need_p=need_p)
    tok, lp = draw(z, keys, vocab_offsets(z.shape[-1], z.device) if offsets is None else offsets)
    if greedy == "some":
        tok_greedy = logits.argmax(-1)
        lp_greedy = torch.log_softmax(logits.float(), -1).gather(-1, tok_greedy[:, None]).squeeze(-1)
        tok, lp = torch.where(is_greedy, tok_greedy, tok), torch.where(is_greedy, lp_greedy, lp)
    return tok, lp
