"""KL estimators, loss aggregation (micro-batch invariance), entropy bonus, TIS / MIS corrections."""
import math

import pytest
import torch
from algo_helpers import params

from megaforge.algorithms import KL_ESTIMATORS, aggregate, mismatch_weights, policy_objective
from megaforge.types import TrainBatch

# Tolerances: float64 throughout (eps 2.2e-16). pytest.approx's default (rel 1e-6) and the explicit
# 1e-9..1e-12 bounds of the micro-batch test (sums over <= 6 rows in another grouping) are >= 1e3 x
# the rounding of a few dozen float64 ops; the KL identity (rel 1e-12) sums 5 float64 terms.


# ------------------------------------------------------------------------------------------ KL
def test_kl_estimator_values():
    lp = torch.tensor([0.5, -0.5, 0.0, 30.0]) - 1.0
    ref = torch.full((4,), -1.0)
    lr = [0.5, -0.5, 0.0, 30.0]
    assert torch.allclose(KL_ESTIMATORS.get("k1")(lp, ref), torch.tensor(lr))
    assert torch.allclose(KL_ESTIMATORS.get("k2")(lp, ref), torch.tensor([0.5 * x * x for x in lr]))
    k3 = [math.exp(-x) - 1 + x for x in lr]
    assert torch.allclose(KL_ESTIMATORS.get("k3")(lp, ref), torch.tensor(k3))
    # low_var_kl: k3 with log r clamped to [-20, 20] and the value clamped to [-10, 10]
    low = KL_ESTIMATORS.get("low_var_kl")(lp, ref)
    assert torch.allclose(low[:3], torch.tensor(k3[:3]))
    assert float(low[3]) == 10.0


def test_k1_and_k3_are_unbiased_k2_is_not():
    """Exact expectations under pi over a 5-token vocabulary: E[k1] = E[k3] = KL(pi || ref)."""
    pi = torch.softmax(torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0], dtype=torch.float64), 0)
    ref = torch.softmax(torch.tensor([0.3, 0.9, -0.1, 1.0, 0.5], dtype=torch.float64), 0)
    kl = float((pi * (pi.log() - ref.log())).sum())
    for name in ("k1", "k3", "low_var_kl"):
        est = KL_ESTIMATORS.get(name)(pi.log(), ref.log())
        assert float((pi * est).sum()) == pytest.approx(kl, rel=1e-12)
    k2 = KL_ESTIMATORS.get("k2")(pi.log(), ref.log())
    assert float((pi * k2).sum()) != pytest.approx(kl, rel=1e-3)
    assert torch.all(KL_ESTIMATORS.get("k3")(pi.log(), ref.log()) >= 0)


def test_k3_gradient():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    (g,) = torch.autograd.grad(KL_ESTIMATORS.get("k3")(lp, ref).sum(), lp)
    assert torch.allclose(g, 1 - torch.exp(ref - lp.detach()))  # 1 - pi_ref / pi


# --------------------------------------------------------------------------------- aggregation
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expect", [
    ("token_mean", (1 + 2 + 4 + 5 + 6) / 5),
    ("seq_mean_token_sum", (3 + 15) / 2),
    ("seq_mean_token_mean", (1.5 + 5.0) / 2),
    ("seq_mean_token_sum_norm", (3 + 15) / (2 * 4.0)),
])
def test_aggregation_values(mode, expect):
    assert float(aggregate(X, M, mode, num_tokens=5, num_seqs=2, norm=4.0)) == pytest.approx(expect)


def test_norm_aggregation_needs_a_normaliser():
    with pytest.raises(ValueError, match="loss_agg_norm"):
        aggregate(X, M, "seq_mean_token_sum_norm", 5, 2, 0.0)


def _batch(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 6, 3, 7, 4])
    tokens = torch.randint(1, 50, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b, n in enumerate(lengths.tolist()):
        mask[b, 2:n] = 1.0
    mask[3] = 0  # a row with no trained token
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    roll = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    ent = torch.rand(B, T, generator=g, dtype=torch.float64)
    batch = TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask.double(), advantages=adv,
                       rollout_logprobs=roll * mask, old_logprobs=old, ref_logprobs=ref)
    batch.num_tokens = int(mask.sum())
    batch.num_seqs = int((mask.sum(-1) > 0).sum())
    return batch, lp, ent


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "sapo", "reinforce"])
def test_micro_batch_split_does_not_change_loss_or_gradient(mode, loss):
    batch, lp0, ent0 = _batch()
    p = params(loss=loss, loss_agg=mode, loss_agg_norm=5.0, beta=0.05, kl_estimator="k3", entropy_coef=0.01,
               clip_c=3.0, tis_cap=2.0, reinforce_clip=0.2)
    lp = lp0.clone().requires_grad_(True)
    ent = ent0.clone().requires_grad_(True)
    whole, m_whole = policy_objective(lp, batch, p, ent)
    g_whole = torch.autograd.grad(whole, (lp, ent))
    for split in ([0, 2, 6], [0, 1, 4, 5, 6], [0, 3, 6]):
        lp2 = lp0.clone().requires_grad_(True)
        ent2 = ent0.clone().requires_grad_(True)
        total, metrics = 0.0, {}
        for a, b in zip(split, split[1:]):
            mb = batch.select(slice(a, b))
            T = mb.tokens.shape[1]
            l, m = policy_objective(lp2[a:b, :T], mb, p, ent2[a:b, :T])
            total = total + l
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
        g = torch.autograd.grad(total, (lp2, ent2))
        assert float(total.detach()) == pytest.approx(float(whole.detach()), rel=1e-10, abs=1e-12)
        assert torch.allclose(g[0], g_whole[0], atol=1e-12) and torch.allclose(g[1], g_whole[1], atol=1e-12)
        for k, v in m_whole.items():
            assert metrics[k] == pytest.approx(float(v), rel=1e-9, abs=1e-12), k


def test_objective_terms_hand_computed():
    """loss = token_mean(pg + beta * k1 - entropy_coef * H) on two tokens."""
    lp = torch.tensor([[0.0, -1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.5, -1.0]], dtype=torch.float64)
    roll = torch.tensor([[0.0, -1.25, -1.5]], dtype=torch.float64)
    ent = torch.tensor([[0.0, 2.0, 3.0]], dtype=torch.float64)
    b = TrainBatch(tokens=torch.zeros(1, 3, dtype=torch.long), lengths=torch.tensor([3]), loss_mask=mask,
                   advantages=torch.tensor([[0.0, 1.0, -1.0]], dtype=torch.float64), rollout_logprobs=roll,
                   ref_logprobs=ref, num_tokens=2, num_seqs=1)
    p = params(beta=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = policy_objective(lp, b, p, ent)
    pg = [-1.0, 1.0]  # on-policy ppo: -A
    kl = [0.5, -1.0]
    expect = sum(pg[i] + 0.1 * kl[i] - 0.01 * [2.0, 3.0][i] for i in range(2)) / 2
    assert float(loss.detach()) == pytest.approx(expect)
    assert float(m["kl"]) == pytest.approx(sum(kl) / 2)
    assert float(m["entropy"]) == pytest.approx(2.5)
    assert float(m["train_rollout_logprob_abs_diff"]) == pytest.approx((0.25 + 0.5) / 2)
    # the KL in the reward instead: no KL term in the loss, still logged
    loss2, m2 = policy_objective(lp, b, params(beta=0.1, kl_estimator="k1", kl_in_reward=True))
    assert float(loss2.detach()) == pytest.approx(0.0) and float(m2["kl"]) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="entropy"):
        policy_objective(lp, b, params(entropy_coef=0.1))


# ------------------------------------------------------------------------------------- TIS/MIS
L2, L05, L4, L15, L12 = math.log(2), math.log(0.5), math.log(4), math.log(1.5), math.log(1.2)
OLD = torch.tensor([[L2, L05, L4], [L15, L12, 0.7]], dtype=torch.float64)  # 0.7: padding, ignored
ROLL = torch.zeros_like(OLD)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def w_of(**kw):
    w, st = mismatch_weights(OLD, ROLL, MASK, params(**kw))
    return (w * MASK).tolist(), st


@pytest.mark.parametrize("kw,expect", [
    (dict(), [[1, 1, 1], [1, 1, 0]]),
    (dict(tis_cap=3.0), [[2, 0.5, 3], [1.5, 1.2, 0]]),
    (dict(tis_cap=3.0, tis_level="sequence"), [[3, 3, 3], [1.8, 1.8, 0]]),  # products 4 and 1.8
    (dict(mis_threshold=3.0), [[2, 0.5, 0], [1.5, 1.2, 0]]),
    (dict(mis_threshold=3.0, mis_threshold_low=0.6), [[2, 0, 0], [1.5, 1.2, 0]]),
    (dict(mis_threshold=3.0, mis_level="sequence"), [[0, 0, 0], [1.8, 1.8, 0]]),
    (dict(mis_threshold=1.5, mis_level="geometric"), [[0, 0, 0], [1, 1, 0]]),  # 4^(1/3)=1.59, 1.8^(1/2)=1.34
    (dict(tis_cap=1.8, mis_threshold=3.0), [[1.8, 0.5, 0], [1.5, 1.2, 0]]),
])
def test_tis_and_mis_weights(kw, expect):
    w, _ = w_of(**kw)
    assert torch.allclose(torch.tensor(w, dtype=torch.float64), torch.tensor(expect, dtype=torch.float64))


def test_mismatch_stats_and_objective_use():
    _, st = w_of(tis_cap=3.0, mis_threshold=3.5)
    assert (st["tis_clip_frac"] * MASK).tolist() == [[0, 0, 1], [0, 0, 0]]
    assert (st["mis_masked_frac"] * MASK).tolist() == [[0, 0, 1], [0, 0, 0]]
    # in the objective the weights multiply the policy loss: on-policy ppo gives -A * w
    lp = OLD.clone().requires_grad_(True)
    b = TrainBatch(tokens=torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([3, 2]), loss_mask=MASK,
                   advantages=MASK.clone(), rollout_logprobs=ROLL, num_tokens=5, num_seqs=2)
    loss, m = policy_objective(lp, b, params(tis_cap=3.0))
    assert float(loss.detach()) == pytest.approx(-(2 + 0.5 + 3 + 1.5 + 1.2) / 5)
    assert float(m["tis_clip_frac"]) == pytest.approx(1 / 5)
    assert float(m["train_rollout_logprob_abs_diff"]) == pytest.approx((L2 + abs(L05) + L4 + L15 + L12) / 5)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(g * MASK, -torch.tensor([[2, 0.5, 3], [1.5, 1.2, 0]], dtype=torch.float64) / 5)
