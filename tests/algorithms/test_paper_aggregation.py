"""GSPO and SAPO are their papers' objectives under the default config (issue 21, item 7).

Both papers average per sequence, then over the group's G sequences:
    GSPO (arXiv:2507.18071):  J = (1/G) sum_i min(s_i A_i, clip(s_i, 1-e_lo, 1+e_hi) A_i),
                              s_i = exp((1/|y_i|) sum_t (logp_it - logp_old_it))
    SAPO (arXiv:2511.20347):  J = (1/G) sum_i (1/|y_i|) sum_t f(r_it) A_i,
                              f(r) = sigma(tau (r - 1)) * 4 / tau, tau = tau_pos if A_i > 0 else tau_neg
The references below are written from these formulas (sequence by sequence, no megaforge code) and
compared with megaforge's objective built from a config that leaves algo.loss_agg at its default.
"""

import pytest
import torch

from megaforge.algorithms import ObjectiveParams, POLICY_LOSSES, policy_objective
from megaforge.build import RunBuilder
from megaforge.config import config_from_dict
from megaforge.configtree import ConfigError
from megaforge.types import TrainBatch

BASE = {"model": {"config": "configs/models/tiny-qwen2"}, "data": {"path": "arithmetic", "format": "synthetic"}}

# three sequences of different lengths (2, 4, 1 trained tokens): token_mean weights them 2:4:1, the
# papers 1:1:1, so the two aggregations differ in value and in gradient
LENGTHS = [2, 4, 1]
OLD = [[-1.0, -0.5], [-2.0, -0.3, -0.7, -1.1], [-0.4]]
NEW = [[-0.9, -0.55], [-1.9, -0.35, -0.6, -1.0], [-0.5]]
ADV = [1.2, -0.7, 0.4]


def params_for(loss: str, **algo) -> ObjectiveParams:
    cfg = config_from_dict({**BASE, "algo": {"loss": loss, **algo}, "grpo": {"clip_low": 0.2, "clip_high": 0.28}})
    return RunBuilder(cfg).objective()


def batch_and_logprobs():
    T = max(LENGTHS)
    mask = torch.zeros(3, T, dtype=torch.float64)
    old = torch.zeros(3, T, dtype=torch.float64)
    new = torch.zeros(3, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
        old[i, :n] = torch.tensor(OLD[i], dtype=torch.float64)
        new[i, :n] = torch.tensor(NEW[i], dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None] * mask
    b = TrainBatch(tokens=torch.zeros(3, T, dtype=torch.long), lengths=torch.tensor(LENGTHS), loss_mask=mask,
                   advantages=adv, rollout_logprobs=old.clone(), old_logprobs=old,
                   num_tokens=int(mask.sum()), num_seqs=3)
    return b, new.requires_grad_(True)


def ref_gspo(new_rows, lo=0.2, hi=0.28):
    terms = []
    for i, lp in enumerate(new_rows):
        s = torch.exp(sum(lp[t] - OLD[i][t] for t in range(LENGTHS[i])) / LENGTHS[i])
        terms.append(torch.minimum(s * ADV[i], s.clamp(1 - lo, 1 + hi) * ADV[i]))
    return -sum(terms) / len(terms)


def ref_sapo(new_rows, tau_pos=1.0, tau_neg=1.05):
    terms = []
    for i, lp in enumerate(new_rows):
        tau = tau_pos if ADV[i] > 0 else tau_neg
        f = [torch.sigmoid(tau * (torch.exp(lp[t] - OLD[i][t]) - 1)) * 4 / tau for t in range(LENGTHS[i])]
        terms.append(sum(f) / LENGTHS[i] * ADV[i])
    return -sum(terms) / len(terms)


def test_registry_entries_declare_the_papers_aggregation():
    assert POLICY_LOSSES.declared("gspo") == {"loss_agg": "seq_mean_token_mean"}
    assert POLICY_LOSSES.declared("sapo") == {"loss_agg": "seq_mean_token_mean"}
    assert POLICY_LOSSES.declared("ppo_clip") == {}


@pytest.mark.parametrize("loss,ref", [("gspo", ref_gspo), ("sapo", ref_sapo)])
def test_default_config_gives_the_papers_objective_value_and_gradient(in_root, loss, ref):
    p = params_for(loss)
    assert p.loss_agg == "seq_mean_token_mean"
    b, lp = batch_and_logprobs()
    ours, _ = policy_objective(lp, b, p)
    (g_ours,) = torch.autograd.grad(ours, lp)
    lp_ref = lp.detach().clone().requires_grad_(True)
    rows = [lp_ref[i] for i in range(3)]
    expect = ref(rows)
    (g_ref,) = torch.autograd.grad(expect, lp_ref)
    # float64, tens of operations on values of order 1: 1e-12 covers the rounding
    assert float(ours.detach()) == pytest.approx(float(expect.detach()), rel=1e-12, abs=1e-12)
    assert torch.allclose(g_ours * b.loss_mask, g_ref * b.loss_mask, atol=1e-12)
    # the token mean (the old default) is another objective: the long sequence counts 4/7, not 1/3
    tm, _ = policy_objective(lp, b, ObjectiveParams(**{**p.__dict__, "loss_agg": "token_mean"}))
    assert abs(float(tm.detach()) - float(expect.detach())) > 1e-3


@pytest.mark.parametrize("loss", ["gspo", "sapo"])
def test_contradicting_explicit_aggregation_is_refused(in_root, loss):
    with pytest.raises(ConfigError, match=r"'algo.loss_agg': 'token_mean' contradicts algo.loss '%s'.*"
                                          r"seq_mean_token_mean" % loss):
        params_for(loss, loss_agg="token_mean")
    assert params_for(loss, loss_agg="seq_mean_token_mean").loss_agg == "seq_mean_token_mean"


def test_other_losses_keep_token_mean_and_any_explicit_choice(in_root):
    assert params_for("ppo_clip").loss_agg == "token_mean"
    assert params_for("cispo", loss_agg="seq_mean_token_sum").loss_agg == "seq_mean_token_sum"
