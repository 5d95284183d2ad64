"""Zero-variance edge cases of the normalised advantage estimators (issue 21, item 7).

A group (GRPO) or a batch (REINFORCE++ / GAE whitening) whose values are all equal carries no
learning signal: its advantages must be exactly 0, whatever the float rounding of the mean. The
reference formulas below are written out in plain Python (math.fsum: correctly rounded sums) and
are independent of megaforge's implementation.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from megaforge.algorithms import ADVANTAGES, AdvantageInputs

PATTERNS = (0.1, 0.7, -0.2)


def cfg(std_eps):
    return SimpleNamespace(std_eps=std_eps, gamma=1.0, lam=1.0)


def ref_grpo(rewards, groups, std_eps):
    """(r - mean_g) / (std_g + eps), Bessel std; 0 for a group of one or of equal rewards."""
    out = []
    for r, g in zip(rewards, groups):
        vals = [x for x, h in zip(rewards, groups) if h == g]
        if len(vals) < 2 or len(set(vals)) == 1:
            out.append(0.0)
            continue
        mean = math.fsum(vals) / len(vals)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in vals) / (len(vals) - 1))
        out.append((r - mean) / (std + std_eps))
    return out


def ref_whiten(values, std_eps):
    """(x - mean) / (population std + eps) over the batch; all 0 when every value is equal."""
    if len(set(values)) == 1:
        return [0.0] * len(values)
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in values) / len(values))
    return [(x - mean) / (std + std_eps) for x in values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("std_eps", [0.0, 1e-6])
def test_grpo_equal_float_rewards_give_zero(dtype, std_eps):
    # groups of 2..8 equal rewards of each pattern, next to one group with a real spread
    rewards, groups = [], []
    gid = 0
    for v in PATTERNS:
        for k in range(2, 9):
            rewards += [v] * k
            groups += [gid] * k
            gid += 1
    rewards += [0.1, 0.7, -0.2, 0.7]
    groups += [gid] * 4
    r = torch.tensor(rewards, dtype=dtype)
    mask = torch.ones(len(rewards), 3, dtype=dtype)
    adv = ADVANTAGES.get("grpo")(AdvantageInputs(r, torch.tensor(groups), mask), cfg(std_eps))
    n_equal = len(rewards) - 4
    assert torch.all(adv[:n_equal] == 0), adv[:n_equal, 0].abs().max()  # exactly: no rounding residue
    # the varied group against the reference, computed from the tensor's own (rounded) values;
    # float32: one rounding of each of ~10 operations on values of order 1 -> 1e-6 relative
    ref = ref_grpo([float(x) for x in r], groups, std_eps)[n_equal:]
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert torch.allclose(adv[n_equal:, 0], torch.tensor(ref, dtype=dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("std_eps", [0.0, 1e-6])
@pytest.mark.parametrize("n", [3, 7, 100])
def test_whitening_equal_returns_gives_zero(name, dtype, std_eps, n):
    for v in PATTERNS:
        r = torch.full((n,), v, dtype=dtype)
        mask = torch.ones(n, 5, dtype=dtype)
        mask[0, 3:] = 0  # rows of different lengths: the returns stay equal (no token rewards, gamma 1)
        adv = ADVANTAGES.get(name)(AdvantageInputs(r, torch.arange(n) // 4, mask), cfg(std_eps))
        assert torch.all(adv == 0), (v, adv.abs().max())


def test_default_eps_float32_batch_of_equal_rewards_is_zero():
    """The issue's case: 100 rewards of 0.7 in float32 at the default std_eps gave max |A| 0.107."""
    r = torch.full((100,), 0.7)
    mask = torch.ones(100, 5)
    for name in ("grpo", "reinforce_pp", "reinforce_pp_baseline"):
        adv = ADVANTAGES.get(name)(AdvantageInputs(r, torch.arange(100) // 4, mask), cfg(1e-6))
        assert adv.abs().max() == 0, name


def test_gae_whitening_of_equal_advantages_is_zero():
    # values chosen so that every raw GAE advantage equals 0.7 - 0.1 = 0.6 (one trained token per row)
    n = 7
    mask = torch.zeros(n, 2)
    mask[:, 1] = 1
    inp = AdvantageInputs(torch.full((n,), 0.7), torch.zeros(n, dtype=torch.long), mask,
                          values=torch.full((n, 2), 0.1))
    assert torch.all(ADVANTAGES.get("gae")(inp, cfg(0.0)) == 0)


@pytest.mark.parametrize("std_eps", [0.0, 1e-6])
def test_whitening_of_unequal_returns_matches_the_reference(std_eps):
    # near-equal float32 returns: the centred values must come from an exact mean, not a rounded one
    vals = [0.7, 0.7, 0.7, 0.7000001, 0.7, 0.6999999, 0.7]
    r = torch.tensor(vals)
    mask = torch.ones(len(vals), 1)
    adv = ADVANTAGES.get("reinforce_pp")(AdvantageInputs(r, torch.zeros(len(vals), dtype=torch.long), mask),
                                         cfg(std_eps))
    ref = ref_whiten([float(x) for x in r], std_eps)
    # the float64 result rounded once to float32: 1 ulp of values of order 1 (6e-8 relative)
    assert torch.allclose(adv[:, 0], torch.tensor(ref, dtype=torch.float32), rtol=2e-7, atol=1e-7), (adv[:, 0], ref)


def test_zero_variance_fraction_counts_groups_of_equal_rewards():
    from megaforge.algorithms import zero_variance_fraction

    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5, 0.5, 0.3])
    groups = torch.tensor([7, 7, 7, 3, 3, 9, 9, 4])  # equal, spread, equal, a group of one
    assert zero_variance_fraction(rewards, groups) == 0.75
    assert zero_variance_fraction(torch.tensor([0.0, 1.0]), torch.tensor([0, 0])) == 0.0
    assert zero_variance_fraction(torch.tensor([]), torch.tensor([], dtype=torch.long)) == 0.0
