"""The sampler (megaforge.rollout.embedded.sampling): Gumbel-max draws follow the (truncated) softmax,
counter-based keys make a row's draw independent of its batch, greedy rows take the argmax."""
from __future__ import annotations

import math

import torch

from megaforge.rollout.embedded.sampling import (counter_keys, draw_tokens, gumbel_noise, process_logits,
                                                 sample_from_keys, sample_tokens, vocab_offsets)

#: probability that an exact sampler fails a chi-square check below (its threshold's upper tail)
FALSE_FAILURE = 1e-6
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 3.0, -0.5, 1.5])  # 9 tokens: chi-square with 8 dof


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail P(chi2_dof > x) for an even ``dof`` (closed form: a Poisson sum)."""
    assert dof % 2 == 0
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(dof // 2))


def chi2_threshold(dof: int, tail: float = FALSE_FAILURE) -> float:
    """x with chi2_sf(x, dof) = tail (bisection; chi2_sf decreases in x)."""
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > tail else (lo, mid)
    return hi


def chi2_stat(tok: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the token counts against probabilities p (tokens outside p's support fail)."""
    n = tok.numel()
    counts = torch.bincount(tok, minlength=p.numel()).double()
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the distribution's support was drawn"
    e = n * p[support].double()
    return float(((counts[support] - e) ** 2 / e).sum())


def _draw(n: int, logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0, position: int = 3):
    return sample_tokens(logits.repeat(n, 1), torch.full((n,), temperature), torch.full((n,), top_k),
                         torch.full((n,), top_p), seeds=torch.arange(n), positions=torch.full((n,), position))


def test_draws_follow_softmax():
    """100,000 seeded draws (one per request seed) at temperature 0.7 against softmax(z / 0.7).

    The draws are fixed by their seeds, so the outcome is deterministic; an exact sampler exceeds the
    threshold with probability FALSE_FAILURE (1e-6). The sampler's bias bound (module docstring:
    total variation <= 3.6e-8 at this V) moves the statistic's mean by < 1e-6. Power: a 3% error in
    the temperature gives a statistic of ~97, over twice the threshold (~42.7): checked below."""
    n, T = 100_000, 0.7
    tok, lp = _draw(n, LOGITS, T)
    limit = chi2_threshold(LOGITS.numel() - 1)
    assert chi2_stat(tok, torch.softmax(LOGITS.double() / T, -1)) < limit
    assert chi2_stat(tok, torch.softmax(LOGITS.double() / (T * 1.03), -1)) > limit  # the check can fail
    # logprob = log q[token]: float32 log-softmax of values <= 4.3 (ulp 4.8e-7) against float64's
    assert torch.allclose(lp.double(), torch.log_softmax(LOGITS.double() / T, -1)[tok], atol=2e-6)


def test_truncated_draws_follow_the_renormalised_distribution():
    """top-k 3 and top-p 0.85 at temperature 1.3: only the kept tokens (3; 5, the mass before the
    6th being 0.90) are drawn, in proportion to the renormalised softmax (false failure
    FALSE_FAILURE per check, as above)."""
    n = 60_000
    for top_k, top_p, kept in ((3, 1.0, 3), (-1, 0.85, 5)):
        z = process_logits(LOGITS[None], torch.tensor([1.3]), torch.tensor([top_k]), torch.tensor([top_p]))[0]
        q = torch.softmax(z.double(), -1)
        assert int((q > 0).sum()) == kept
        tok, lp = _draw(n, LOGITS, 1.3, top_k, top_p)
        assert chi2_stat(tok, q) < chi2_threshold(kept - 1)
        # the renormalised logprob: float32 log-softmax over the kept tokens (ulp <= 4.8e-7)
        assert torch.allclose(lp.double(), torch.log(q)[tok], atol=2e-6)


def test_a_row_draws_the_same_whatever_its_batch():
    """Tokens and logprobs of each (seed, position) row: alone, in a batch, in another order."""
    g = torch.Generator().manual_seed(0)
    B, V = 12, 1000
    logits = 3 * torch.randn(B, V, generator=g)
    temp, top_k, top_p = torch.full((B,), 0.9), torch.full((B,), -1), torch.ones(B)
    seeds, pos = torch.randint(0, 2 ** 40, (B,), generator=g), torch.randint(0, 4000, (B,), generator=g)
    tok, lp = sample_tokens(logits, temp, top_k, top_p, seeds=seeds, positions=pos)
    perm = torch.randperm(B, generator=g)
    tok_p, lp_p = sample_tokens(logits[perm], temp, top_k, top_p, seeds=seeds[perm], positions=pos[perm])
    assert torch.equal(tok_p, tok[perm]) and torch.equal(lp_p, lp[perm])
    keys = counter_keys(seeds, pos)
    noise = gumbel_noise(keys, vocab_offsets(V))
    for b in range(B):
        one_tok, one_lp = sample_tokens(logits[b:b + 1], temp[:1], top_k[:1], top_p[:1], seeds=seeds[b:b + 1],
                                        positions=pos[b:b + 1])
        assert one_tok.item() == tok[b].item()
        # one row's float32 log-softmax over 1000 values, alone or in a batch: the same kernel per row
        # (bit-equal measured); 1e-6 allows a vector-width change of the sum order (|lp| <= ~15)
        assert abs(one_lp.item() - lp[b].item()) <= 1e-6
        assert torch.equal(gumbel_noise(keys[b:b + 1], vocab_offsets(V))[0], noise[b])  # elementwise: exactly the same
    # other positions or seeds draw other noise
    assert not torch.equal(gumbel_noise(counter_keys(seeds, pos + 1), vocab_offsets(V)), noise)
    assert len(set(tok.tolist())) > 1


def test_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(1)
    B, V = 6, 300
    logits = torch.randn(B, V, generator=g)
    temp = torch.tensor([0.0, 1.0, 0.0, 0.7, 1.2, 0.0])
    keys = counter_keys(torch.arange(B), torch.zeros(B, dtype=torch.long))
    args = (torch.full((B,), -1), torch.ones(B))
    tok, lp = sample_from_keys(logits, temp, *args, keys, False, False, "some")
    greedy = temp <= 0
    ref_lp = torch.log_softmax(logits, -1)
    assert torch.equal(tok[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(lp[greedy], ref_lp.gather(-1, tok[:, None]).squeeze(-1)[greedy])
    other = sample_from_keys(logits[~greedy], temp[~greedy], *(a[~greedy] for a in args), keys[~greedy], False, False,
                             "none")
    assert torch.equal(tok[~greedy], other[0]) and torch.equal(lp[~greedy], other[1])
    all_greedy = sample_from_keys(logits, torch.zeros(B), *args, None, False, False, "all")
    assert torch.equal(all_greedy[0], logits.argmax(-1))
    assert torch.equal(all_greedy[1], ref_lp.gather(-1, all_greedy[0][:, None]).squeeze(-1))


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_noise_equals_the_unsigned_64_bit_reference():
    """counter_keys / gumbel_noise (int64 tensors, wrap-around) against Python integers modulo 2^64."""
    golden, m = 0x9E3779B97F4A7C15, (1 << 64) - 1
    seeds, pos = [0, 1, 12345, 2 ** 62 - 1, 7], [0, 0, 99, 2 ** 40, 5]
    keys = counter_keys(torch.tensor(seeds), torch.tensor(pos))
    V = 40
    noise = gumbel_noise(keys, vocab_offsets(V))
    for b, (s, p) in enumerate(zip(seeds, pos)):
        key = _splitmix64(s * golden + p + 1)
        assert int(keys[b]) & m == key
        for v in range(V):
            h = _splitmix64(key + (v + 1) * golden)
            t = (float(h & ((1 << 62) - 1)) + 0.5) * 2.0 ** -63
            e = -math.log(t) if h >> 63 else -math.log1p(-t)
            # two float64 log implementations (ATen's vectorised, libm's), <= ~2 ulp each, |g| < 45
            assert abs(noise[b, v].item() - (-math.log(e))) <= 1e-13
    draws = noise.flatten()  # 200 standard Gumbel values: mean 0.577 (sd 0.09), variance 1.64
    assert abs(draws.mean().item() - 0.5772) < 0.5 and 0.8 < draws.var().item() < 3.0


def test_draw_tokens_is_the_gumbel_argmax():
    """draw_tokens: argmax of z + noise (float64), removed tokens (-inf) never drawn."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 64, generator=g)
    z[:, 10:] = float("-inf")
    keys = counter_keys(torch.arange(5), torch.full((5,), 2))
    tok, lp = draw_tokens(z, keys, vocab_offsets(64))
    assert torch.equal(tok, (z.double() + gumbel_noise(keys, vocab_offsets(64))).argmax(-1))
    assert (tok < 10).all() and torch.equal(lp, torch.log_softmax(z, -1).gather(-1, tok[:, None]).squeeze(-1))
