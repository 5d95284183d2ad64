"""Policy losses against hand-computed values and gradients on small tensors."""
import math

import pytest
import torch
from algo_helpers import lp_for_ratio, params

from megaforge.algorithms import POLICY_LOSSES, aggregate

# Tolerances: float64 throughout (eps 2.2e-16), a few ops per element: torch.allclose's defaults
# (rtol 1e-5) and atol=1e-12 are >= 1e3 x the rounding; a formula error moves values by >= 1e-2.

OLD = [[math.log(0.3), math.log(0.6), math.log(0.2)]]


def grad_of(loss, lp):
    (g,) = torch.autograd.grad(loss.sum(), lp)
    return g


# ------------------------------------------------------------------------------------ ppo_clip
def test_ppo_clip_values_and_gradient_clip_higher():
    # r = 1.5 (A=+1: clipped at 1.28), 0.5 (A=-1: clipped at 0.8), 1.1 (A=+1: inside the band)
    lp = lp_for_ratio([[1.5, 0.5, 1.1]], OLD)
    A = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(A)
    loss, st = POLICY_LOSSES.get("ppo_clip")(lp, torch.tensor(OLD, dtype=torch.float64), A, mask,
                                             params(clip_low=0.2, clip_high=0.28))
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -1.1]], dtype=torch.float64))
    assert st["clip_frac"].tolist() == [[1.0, 1.0, 0.0]]
    # d(-A r)/dlogp = -A r on the unclipped token, 0 on clipped ones
    assert torch.allclose(grad_of(loss, lp), torch.tensor([[0.0, 0.0, -1.1]], dtype=torch.float64))


def test_ppo_dual_clip_bounds_negative_advantage_tokens():
    # A = -1: r = 5 gives the PPO loss 5, bounded by clip_c = 3 with zero gradient; r = 2 stays 2
    lp = lp_for_ratio([[5.0, 2.0, 5.0]], OLD)
    A = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(A)
    old = torch.tensor(OLD, dtype=torch.float64)
    loss, st = POLICY_LOSSES.get("ppo_clip")(lp, old, A, mask, params(clip_low=0.2, clip_high=0.28, clip_c=3.0))
    assert torch.allclose(loss, torch.tensor([[3.0, 2.0, -1.28]], dtype=torch.float64))
    assert st["dual_clip_frac"].tolist() == [[1.0, 0.0, 0.0]]
    assert torch.allclose(grad_of(loss, lp), torch.tensor([[0.0, 2.0, 0.0]], dtype=torch.float64))
    # without dual-clip the same token is unbounded
    loss2, _ = POLICY_LOSSES.get("ppo_clip")(lp, old, A, mask, params(clip_low=0.2, clip_high=0.28))
    assert float(loss2[0, 0].detach()) == pytest.approx(5.0)


# ---------------------------------------------------------------------------------------- gspo
def _gspo_setup():
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.7, -0.2, -3.0, 0.0]], dtype=torch.float64)
    dlog = torch.tensor([[0.10, -0.05, 0.30, 0.9], [0.02, -0.01, 0.03, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    lp = (old + dlog).clone().requires_grad_(True)
    return lp, old, mask


def test_gspo_ratio_is_per_sequence_and_values():
    lp, old, mask = _gspo_setup()
    A = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    p = params(clip_low=0.2, clip_high=0.28)
    loss, st = POLICY_LOSSES.get("gspo")(lp, old, A, mask, p)
    s0 = math.exp((0.10 - 0.05 + 0.30) / 3)  # padding (0.9) does not count
    s1 = math.exp((0.02 - 0.01 + 0.03) / 3)
    assert torch.allclose(st["seq_ratio"][0, :3], torch.full((3,), s0, dtype=torch.float64))
    assert torch.allclose(st["seq_ratio"][1, :3], torch.full((3,), s1, dtype=torch.float64))
    assert torch.allclose(loss[0, :3], torch.full((3,), -s0, dtype=torch.float64))
    assert torch.allclose(loss[1, :3], torch.full((3,), s1, dtype=torch.float64))


def test_gspo_gradient_is_the_papers_sequence_gradient():
    """Aggregated per sequence (seq_mean_token_mean), the token form's gradient equals the gradient
    of the paper's sequence objective -mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r)."""
    for clip in (0.2, 0.05):  # inside the band; sequence 0 outside it
        lp, old, mask = _gspo_setup()
        A = torch.tensor([[1.5] * 4, [-0.5] * 4], dtype=torch.float64)
        p = params(clip_low=clip, clip_high=clip)
        loss, _ = POLICY_LOSSES.get("gspo")(lp, old, A, mask, p)
        agg = aggregate(loss, mask, "seq_mean_token_mean", int(mask.sum()), 2)
        (g_ours,) = torch.autograd.grad(agg, lp)
        lp2 = lp.detach().clone().requires_grad_(True)
        s = torch.exp(((lp2 - old) * mask).sum(-1) / mask.sum(-1))
        a = A[:, 0]
        obj = torch.minimum(s * a, s.clamp(1 - clip, 1 + clip) * a).mean()
        (g_ref,) = torch.autograd.grad(-obj, lp2)
        assert torch.allclose(g_ours * mask, g_ref * mask, atol=1e-12)
    # with clip 0.05 sequence 0 (s0 = exp(0.35/3) = 1.12, A > 0) is clipped as a whole: no token of
    # it gets gradient, although token 1's own ratio exp(-0.05) is inside the band
    assert torch.all(g_ours[0] == 0)
    assert torch.all(g_ours[1, :3] != 0)


def test_gspo_one_token_moves_its_whole_sequence_ratio():
    lp, old, mask = _gspo_setup()
    A = torch.ones_like(old)
    _, st = POLICY_LOSSES.get("gspo")(lp, old, A, mask, params())
    lp2 = lp.detach().clone()
    lp2[0, 0] += 0.3
    _, st2 = POLICY_LOSSES.get("gspo")(lp2, old, A, mask, params())
    assert torch.all(st2["seq_ratio"][0, :3] > st["seq_ratio"][0, :3])
    assert torch.equal(st2["seq_ratio"][1], st["seq_ratio"][1])


# --------------------------------------------------------------------------------------- cispo
def test_cispo_clipped_tokens_keep_gradient():
    lp = lp_for_ratio([[2.0, 0.1, 1.1]], OLD)
    old = torch.tensor(OLD, dtype=torch.float64)
    A = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones_like(A)
    loss, st = POLICY_LOSSES.get("cispo")(lp, old, A, mask, params(clip_high=0.28))
    w = torch.tensor([[1.28, 0.1, 1.1]], dtype=torch.float64)  # no lower bound by default
    assert torch.allclose(loss, -w * A * lp.detach())
    assert torch.allclose(grad_of(loss, lp), -w * A)  # every token, clipped or not, has gradient
    assert st["clip_frac"].tolist() == [[1.0, 0.0, 0.0]]
    # the same tokens under ppo_clip: the clipped one gets no gradient
    ppo, _ = POLICY_LOSSES.get("ppo_clip")(lp, old, A, mask, params(clip_high=0.28))
    assert float(grad_of(ppo, lp)[0, 0]) == 0.0
    # a lower bound clips the small ratio too
    loss2, st2 = POLICY_LOSSES.get("cispo")(lp, old, A, mask, params(clip_high=0.28, cispo_clip_low=0.5))
    assert torch.allclose(grad_of(loss2, lp), -torch.tensor([[1.28, 0.5, 1.1]], dtype=torch.float64) * A)
    assert st2["clip_frac"].tolist() == [[1.0, 1.0, 0.0]]


# ---------------------------------------------------------------------------------------- sapo
def test_sapo_gate_values_and_gradient():
    ratios = [[1.0, 1.5, 0.6, 3.0]]
    old = torch.tensor([[-1.0, -0.5, -2.0, -1.2]], dtype=torch.float64)
    lp = lp_for_ratio(ratios, old)
    A = torch.tensor([[2.0, 1.0, -1.0, -0.5]], dtype=torch.float64)
    mask = torch.ones_like(A)
    tp, tn = 1.0, 1.05
    loss, st = POLICY_LOSSES.get("sapo")(lp, old, A, mask, params(sapo_tau_pos=tp, sapo_tau_neg=tn))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    exp_loss, exp_grad, exp_gate = [], [], []
    for r, a in zip(ratios[0], A[0].tolist()):
        tau = tp if a > 0 else tn
        s = sig(tau * (r - 1))
        exp_loss.append(-(4 / tau) * s * a)
        exp_gate.append(4 * s * (1 - s))
        exp_grad.append(-4 * s * (1 - s) * r * a)  # d f(r)/dlogp = f'(r) r
    assert torch.allclose(loss, torch.tensor([exp_loss], dtype=torch.float64))
    assert torch.allclose(grad_of(loss, lp), torch.tensor([exp_grad], dtype=torch.float64))
    assert torch.allclose(st["sapo_gate"], torch.tensor([exp_gate], dtype=torch.float64))
    # on-policy the gate is exactly 1: the gradient is the plain policy gradient -A
    assert exp_gate[0] == pytest.approx(1.0) and exp_grad[0] == pytest.approx(-2.0)
    # far off-policy the gate has decayed (no hard cut-off, no exact zero)
    assert 0 < exp_gate[3] < 0.5


def test_sapo_negative_temperature_decays_faster():
    old = torch.zeros((1, 2), dtype=torch.float64)
    lp = lp_for_ratio([[1.8, 1.8]], old)
    A = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    _, st = POLICY_LOSSES.get("sapo")(lp, old, A, torch.ones_like(A), params(sapo_tau_pos=1.0, sapo_tau_neg=4.0))
    assert float(st["sapo_gate"][0, 1]) < float(st["sapo_gate"][0, 0])


# ----------------------------------------------------------------------------------- reinforce
def test_reinforce_on_policy_and_clipped_ratio():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    A = torch.tensor([[1.0, -1.0, 0.5]], dtype=torch.float64)
    mask = torch.ones_like(A)
    loss, _ = POLICY_LOSSES.get("reinforce")(lp, lp.detach(), A, mask, params())
    assert torch.allclose(loss, -A * lp.detach())
    assert torch.allclose(grad_of(loss, lp), -A)
    # off-policy ratios 1.5 / 0.5 / 1.1 with reinforce_clip 0.2: detached weights 1.2 / 0.8 / 1.1
    lp2 = lp_for_ratio([[1.5, 0.5, 1.1]], OLD)
    old = torch.tensor(OLD, dtype=torch.float64)
    loss2, st = POLICY_LOSSES.get("reinforce")(lp2, old, A, mask, params(reinforce_clip=0.2))
    assert torch.allclose(grad_of(loss2, lp2), -torch.tensor([[1.2, 0.8, 1.1]], dtype=torch.float64) * A)
    assert st["clip_frac"].tolist() == [[1.0, 1.0, 0.0]]
    loss3, _ = POLICY_LOSSES.get("reinforce")(lp2, old, A, mask, params())  # unclipped IS weight
    assert torch.allclose(grad_of(loss3, lp2), -torch.tensor([[1.5, 0.5, 1.1]], dtype=torch.float64) * A)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "sapo", "reinforce"])
def test_every_loss_is_the_policy_gradient_on_policy(name):
    """At pi = pi_old every loss's gradient is the vanilla policy gradient -A (per token)."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.9, -1.1]], dtype=torch.float64, requires_grad=True)
    A = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    mask = torch.ones_like(A)
    loss, _ = POLICY_LOSSES.get(name)(lp, lp.detach(), A, mask, params())
    assert torch.allclose(grad_of(loss, lp), -A)
