"""algo.kl_in_reward: the per-token KL penalty is taken from the trainer's old log-probs (pi_old under
the current policy, as verl), not from the engine's rollout log-probs (issue 21, item 7)."""
import math

import torch

from megaforge.config import config_from_dict
from megaforge.build import RunBuilder
from megaforge.driver.steps import batch_advantages
from megaforge.types import TrainBatch


MODEL = {"model": {"config": "configs/models/tiny-qwen2"}, "data": {"path": "arithmetic", "format": "synthetic"}}


def needs_old_logprobs(cfg) -> bool:
    return RunBuilder(cfg).step_settings().needs_old_logprobs


def cfg_of(**sections):
    return config_from_dict({**MODEL, **sections})


def kl_cfg(**algo):
    return cfg_of(algo={"advantage": "reinforce_pp", "kl_in_reward": True, "kl_estimator": "k1", "std_eps": 0.0,
                        "gamma": 1.0, **algo}, grpo={"beta": 0.5})


def batch():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, -0.8, -2.5], [0.0, -0.1, 0.0]], dtype=torch.float64)
    return TrainBatch(tokens=torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([3, 2]), loss_mask=mask,
                      advantages=torch.zeros(2, 3, dtype=torch.float64),
                      rollout_logprobs=ref.clone(),  # the engine's log-probs: a KL of 0 if they were used
                      old_logprobs=old, ref_logprobs=ref, rewards=torch.tensor([1.0, 0.0], dtype=torch.float64),
                      group_ids=torch.tensor([0, 0]))


def test_kl_penalty_comes_from_the_trainers_old_logprobs(in_root):
    cfg = kl_cfg()
    b = batch()
    adv = batch_advantages(b, RunBuilder(cfg).step_settings())
    # reference: r_t = -beta * (old_t - ref_t) on trained tokens, + R at each row's last trained token,
    # G_t = sum_{s >= t} r_s (gamma 1), whitened over the 3 trained tokens (population std)
    beta = 0.5
    r00, r01 = -beta * (-0.8 + 1.0), -beta * (-2.5 + 2.0) + 1.0
    r10 = -beta * (-0.1 + 0.5) + 0.0
    g = [r00 + r01, r01, r10]
    mean = math.fsum(g) / 3
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in g) / 3)
    w = [(x - mean) / sd for x in g]
    expect = torch.tensor([[0.0, w[0], w[1]], [0.0, w[2], 0.0]], dtype=torch.float64)
    assert torch.allclose(adv, expect, rtol=1e-12, atol=1e-12), adv  # float64, a handful of operations


def test_kl_in_reward_makes_the_trainer_compute_old_logprobs(in_root):
    assert needs_old_logprobs(kl_cfg())  # one mini-batch, one epoch: still needed for the penalty
    assert not needs_old_logprobs(kl_cfg(kl_in_reward=False))
    assert not needs_old_logprobs(cfg_of(grpo={"beta": 0.0}, algo={"advantage": "reinforce_pp", "kl_in_reward": True}))
    assert needs_old_logprobs(cfg_of(trainer={"epochs": 2}))


def test_kl_reward_penalty_values():
    from megaforge.algorithms import kl_reward_penalty

    old = torch.tensor([[-0.8, -2.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0]])
    mask = torch.tensor([[1.0, 0.0]])
    r = kl_reward_penalty(old, ref, mask, 0.1, "k3")
    # k3 = exp(ref - old) - 1 - (ref - old); masked token gets 0; no gradient flows into the reward
    lr = -0.8 + 1.0
    assert not r.requires_grad
    assert torch.allclose(r, torch.tensor([[-0.1 * (math.exp(-lr) - 1 + lr), 0.0]]), atol=1e-7)  # float32, 4 ops
