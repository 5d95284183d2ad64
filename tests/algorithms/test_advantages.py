"""Advantage estimators against hand-computed values on small tensors."""
import math
from types import SimpleNamespace

import pytest
import torch

from megaforge.algorithms import ADVANTAGES, AdvantageInputs, gae, value_targets

# Tolerances: float32 results of at most ~10 elementwise ops and sums over <= 7 values of size <= 3,
# against float64 hand computations: rounding <= ~10 ulp (~2e-6). torch.allclose's default
# rtol 1e-5 (~80 ulp) and atol=1e-6 (which keeps rtol 1e-5: |d| <= 1e-6 + 1e-5 |want|) cover it on any
# kernel; a formula error moves a value by >= 1e-2. Sums this small are not reordered by vector width.


def cfg(**kw):
    base = dict(std_eps=0.0, gamma=1.0, lam=1.0)
    base.update(kw)
    return SimpleNamespace(**base)


def seq_inputs():
    # group 0: rewards 1, 0, 0, 1; group 7: 2, 2 (equal); group 3: a single sample
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 0, 0, 7, 7, 3])
    mask = torch.ones((7, 3))
    mask[0, 2] = 0  # a shorter response: its padding gets 0
    return AdvantageInputs(rewards, groups, mask)


def test_grpo():
    inp = seq_inputs()
    adv = ADVANTAGES.get("grpo")(inp, cfg())
    std = math.sqrt(4 * 0.25 / 3)  # Bessel
    expect = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0, 0.0]
    assert torch.allclose(adv[:, 0], torch.tensor(expect))
    assert torch.allclose(adv[:, 1], torch.tensor(expect))
    assert adv[0, 2] == 0  # padding


def test_dr_grpo_and_rloo():
    inp = seq_inputs()
    dr = ADVANTAGES.get("dr_grpo")(inp, cfg())
    assert torch.allclose(dr[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))
    rloo = ADVANTAGES.get("rloo")(inp, cfg())
    # r_i - mean of the other three: 1 - 1/3, 0 - 2/3
    assert torch.allclose(rloo[:, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0]))


def _whiten(values):
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / len(values))
    return [(v - m) / sd for v in values]


def token_inputs():
    # row 0: response at t = 1..3; row 1: model tokens at t = 1 and 3, a tool output at t = 2
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    tr = torch.tensor([[0.0, -0.1, -0.2, -0.3], [0.0, -0.2, -9.0, -0.4]])  # -9 sits on an untrained token
    return AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, token_rewards=tr)


def test_reinforce_pp_hand_computed():
    inp = token_inputs()
    adv = ADVANTAGES.get("reinforce_pp")(inp, cfg(gamma=0.5))
    # row 0: r = [-0.1, -0.2, -0.3 + 1]; G3 = 0.7, G2 = -0.2 + 0.35 = 0.15, G1 = -0.1 + 0.075 = -0.025
    # row 1: r = [-0.2, -0.4] over its trained tokens (the tool step is skipped): G3 = -0.4, G1 = -0.4
    w = _whiten([-0.025, 0.15, 0.7, -0.4, -0.4])
    expect = torch.tensor([[0.0, w[0], w[1], w[2]], [0.0, w[3], 0.0, w[4]]])
    assert torch.allclose(adv, expect, atol=1e-6)


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    inp = token_inputs()  # group mean reward 0.5
    adv = ADVANTAGES.get("reinforce_pp_baseline")(inp, cfg(gamma=1.0))
    # row 0: r = [-0.1, -0.2, -0.3 + 0.5] -> G = [-0.1, 0.0, 0.2]; row 1: r = [-0.2, -0.4 - 0.5] -> G = [-1.1, -0.9]
    w = _whiten([-0.1, 0.0, 0.2, -1.1, -0.9])
    expect = torch.tensor([[0.0, w[0], w[1], w[2]], [0.0, w[3], 0.0, w[4]]])
    assert torch.allclose(adv, expect, atol=1e-6)
    # without token rewards and with equal rewards in the group everything is 0 before whitening
    flat = AdvantageInputs(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), inp.loss_mask)
    assert torch.all(ADVANTAGES.get("reinforce_pp_baseline")(flat, cfg(std_eps=1e-6)) == 0)


def test_gae_hand_computed():
    inp = token_inputs()
    inp.values = torch.tensor([[9.0, 0.5, 0.4, 0.8], [9.0, 0.1, 7.0, 0.3]])  # 9, 7: untrained, ignored
    g, lam = 0.9, 0.8
    raw, ret = gae(inp, cfg(gamma=g, lam=lam))
    # row 0 steps: (r, V) = (-0.1, 0.5), (-0.2, 0.4), (0.7, 0.8)
    d3 = 0.7 - 0.8
    d2 = -0.2 + g * 0.8 - 0.4
    d1 = -0.1 + g * 0.4 - 0.5
    a3 = d3
    a2 = d2 + g * lam * a3
    a1 = d1 + g * lam * a2
    # row 1 steps: (-0.2, 0.1), (-0.4, 0.3)
    e3 = -0.4 - 0.3
    e1 = -0.2 + g * 0.3 - 0.1
    b3, b1 = e3, e1 + g * lam * e3
    expect = torch.tensor([[0.0, a1, a2, a3], [0.0, b1, 0.0, b3]])
    assert torch.allclose(raw, expect, atol=1e-6)
    assert torch.allclose(ret, (expect + inp.values * inp.loss_mask) * inp.loss_mask, atol=1e-6)
    assert torch.allclose(value_targets(inp, cfg(gamma=g, lam=lam)), ret)
    adv = ADVANTAGES.get("gae")(inp, cfg(gamma=g, lam=lam))
    w = _whiten([a1, a2, a3, b1, b3])
    assert torch.allclose(adv, torch.tensor([[0.0, w[0], w[1], w[2]], [0.0, w[3], 0.0, w[4]]]), atol=1e-6)


def test_gae_lambda_one_is_the_monte_carlo_return_and_needs_values():
    inp = token_inputs()
    inp.values = torch.rand(2, 4)
    _, ret = gae(inp, cfg(gamma=0.5, lam=1.0))
    # lambda = 1: returns are the discounted returns, whatever the values
    expect = torch.tensor([[0.0, -0.025, 0.15, 0.7], [0.0, -0.4, 0.0, -0.4]])
    assert torch.allclose(ret, expect, atol=1e-6)
    inp.values = None
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGES.get("gae")(inp, cfg())
