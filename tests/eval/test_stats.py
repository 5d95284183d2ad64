"""pass@k (Chen et al. 2021) and the per-set aggregation against hand-computed values."""
from fractions import Fraction
from math import comb

import pytest

from megaforge.eval.stats import SampleResult, mean_pass_at_k, pass_at_k, summarize


def exact(n, c, k):
    """The estimator's definition with exact integers: 1 - C(n-c, k) / C(n, k)."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize("n,c,k,want", [
    (5, 2, 1, Fraction(2, 5)),   # 1 - 3/5: pass@1 is c/n
    (5, 2, 2, Fraction(7, 10)),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, Fraction(9, 10)),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, Fraction(1)),      # n - c = 3 < k: every draw of 4 holds a correct one
    (4, 0, 3, Fraction(0)),
    (8, 8, 8, Fraction(1)),
    (8, 1, 8, Fraction(1)),
    (10, 3, 5, Fraction(11, 12)),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
])
def test_pass_at_k_hand_values(n, c, k, want):
    assert exact(n, c, k) == want  # the hand value is the definition
    # float product of at most c factors (1 - k/i): rounding ~c * 1e-16
    assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    # C(1000, 500) has 300 digits: the product form needs no big numbers and loses nothing
    n, c, k = 1000, 7, 500
    want = float(exact(n, c, k))
    assert 0.99 < want < 1.0
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)  # 7 factors of float rounding


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        mean_pass_at_k([], 4, 1)


def test_mean_pass_at_k_averages_prompts():
    # prompts with 1 and 3 correct of 3: pass@2 = mean(1 - C(2,2)/C(3,2), 1) = mean(2/3, 1) = 5/6
    assert mean_pass_at_k([1, 3], 3, 2) == pytest.approx(5 / 6, abs=1e-12)


def _r(i, mode, correct, reward=None, length=4, finish="stop", comps=None):
    reward = float(correct) if reward is None else reward
    return SampleResult(i, mode, reward, comps if comps is not None else {"math": float(correct)}, correct, length, finish)


def test_summarize_greedy_and_sampled():
    results = [
        _r(0, "greedy", True, length=3), _r(1, "greedy", False, length=5, finish="length"),
        # prompt 0: 1 of 3 correct, prompt 1: 3 of 3
        _r(0, "sampled", True, length=2), _r(0, "sampled", False, length=4), _r(0, "sampled", False, length=6),
        _r(1, "sampled", True, length=8, finish="length"), _r(1, "sampled", True), _r(1, "sampled", True),
    ]
    m = summarize(results, 2, [1, 2, 3], n_samples=3)
    assert m["prompts"] == 2
    assert m["greedy/pass@1"] == 0.5
    assert m["greedy/reward/mean"] == 0.5 and m["greedy/reward/math"] == 0.5
    assert m["greedy/response_len/mean"] == 4.0
    assert m["greedy/response/length_frac"] == 0.5
    assert m["sampled/pass@1"] == pytest.approx((1 / 3 + 1) / 2, abs=1e-12)
    assert m["sampled/pass@2"] == pytest.approx(5 / 6, abs=1e-12)
    assert m["sampled/pass@3"] == 1.0
    assert m["sampled/reward/mean"] == pytest.approx(4 / 6, abs=1e-12)
    assert m["sampled/response_len/mean"] == pytest.approx(28 / 6, abs=1e-12)
    assert m["sampled/response/length_frac"] == pytest.approx(1 / 6, abs=1e-12)


def test_summarize_components_are_unweighted_means_and_reward_is_the_total():
    results = [_r(0, "greedy", True, reward=0.95, comps={"math": 1.0, "thinking": 0.5}),
               _r(1, "greedy", False, reward=0.05, comps={"math": 0.0, "thinking": 0.5})]
    m = summarize(results, 2, [])
    assert m["greedy/reward/mean"] == pytest.approx(0.5, abs=1e-12)
    assert m["greedy/reward/math"] == 0.5 and m["greedy/reward/thinking"] == 0.5
    assert not any(k.startswith("sampled/") for k in m)


def test_summarize_refuses_incomplete_results():
    with pytest.raises(ValueError, match="cover 1 of 2 prompts"):
        summarize([_r(0, "greedy", True)], 2, [])
    with pytest.raises(ValueError, match="expected 3 per prompt"):
        summarize([_r(0, "sampled", True), _r(0, "sampled", True)], 1, [1], n_samples=3)
    with pytest.raises(ValueError, match="pass@4 needs at least 4"):
        summarize([_r(0, "sampled", True)] * 2, 1, [4], n_samples=2)
    with pytest.raises(ValueError, match="outside"):
        summarize([_r(3, "greedy", True)], 2, [])
