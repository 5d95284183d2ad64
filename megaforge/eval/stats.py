"""Pure evaluation statistics: the unbiased pass@k estimator and the per-set aggregation.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with ``n``
samples of a prompt of which ``c`` are correct, the probability that at least one of ``k`` samples
drawn without replacement from those ``n`` is correct is

    pass@k = 1 - C(n - c, k) / C(n, k)
           = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)        (n - c >= k; else 1)

computed as the product (no large binomials, no cancellation). A set's pass@k is the mean over its
prompts. Greedy pass@1 is the fraction of prompts whose greedy response is correct.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct of ``n`` samples (``1 <= k <= n``)."""
    if not (0 <= c <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """pass@k of a set: the mean of :func:`pass_at_k` over its prompts (``correct_counts[i]`` of
    ``n`` samples of prompt ``i`` are correct)."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k: no prompts")
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)


@dataclass
class SampleResult:
    """One scored evaluation response (what the per-sample jsonl holds, less the texts)."""

    prompt_index: int
    mode: str  # "greedy" | "sampled"
    reward: float  # weighted sum of the reward functions (plus an environment reward)
    components: dict = field(default_factory=dict)  # reward function name -> its unweighted value
    correct: bool = False
    response_len: int = 0
    finish_reason: str = "stop"


def summarize(results: Sequence[SampleResult], n_prompts: int, pass_k: Sequence[int],
              n_samples: Optional[int] = None) -> dict:
    """Metrics of one evaluation set (keys without the ``eval/<set>/`` prefix).

    Per mode present (``greedy``, ``sampled``): ``<mode>/reward/mean``, ``<mode>/reward/<component>``
    (mean unweighted value), ``<mode>/response_len/mean``, ``<mode>/response/length_frac`` (fraction
    cut at the token limit). Greedy adds ``greedy/pass@1``; sampled adds ``sampled/pass@k`` for each ``k`` of ``pass_k`` (unbiased, from
    ``n_samples`` responses per prompt). ``prompts`` is the number of prompts."""
    out: dict = {"prompts": float(n_prompts)}
    for mode in ("greedy", "sampled"):
        rs = [r for r in results if r.mode == mode]
        if not rs:
            continue
        per_prompt: dict[int, list[SampleResult]] = {}
        for r in rs:
            if not 0 <= r.prompt_index < n_prompts:
                raise ValueError(f"summarize: prompt_index {r.prompt_index} outside [0, {n_prompts})")
            per_prompt.setdefault(r.prompt_index, []).append(r)
        want = 1 if mode == "greedy" else n_samples
        uneven = want is not None and any(len(v) != want for v in per_prompt.values())
        if len(per_prompt) != n_prompts or uneven:
            got = sorted({len(v) for v in per_prompt.values()})
            raise ValueError(f"summarize: {mode} results cover {len(per_prompt)} of {n_prompts} prompts with "
                             f"{got} responses each; expected {want} per prompt")
        m = len(rs)
        out[f"{mode}/reward/mean"] = sum(r.reward for r in rs) / m
        for name in sorted({k for r in rs for k in r.components}):
            out[f"{mode}/reward/{name}"] = sum(float(r.components.get(name, 0.0)) for r in rs) / m
        out[f"{mode}/response_len/mean"] = sum(r.response_len for r in rs) / m
        out[f"{mode}/response/length_frac"] = sum(r.finish_reason == "length" for r in rs) / m
        if mode == "greedy":
            out["greedy/pass@1"] = sum(v[0].correct for v in per_prompt.values()) / n_prompts
        else:
            n = len(next(iter(per_prompt.values())))
            counts = [sum(r.correct for r in per_prompt[i]) for i in sorted(per_prompt)]
            for k in pass_k:
                if k > n:
                    raise ValueError(f"summarize: pass@{k} needs at least {k} samples per prompt, got {n}")
                out[f"sampled/pass@{k}"] = mean_pass_at_k(counts, n, k)
    return out
