"""DAPO pieces: the zero-variance group filter, the loop's bounded over-sampling, overlong shaping."""
from types import SimpleNamespace

import pytest
import torch
from algo_helpers import ROOT

from megaforge.algorithms import first_groups, nonzero_variance_groups, overlong_penalty
from megaforge.types import Sample

# Tolerances: float32 penalties of two ops each and means of <= 12 rewards in {0, 1}: a few ulp, far
# inside torch.allclose's rtol 1e-5 and pytest.approx's rel 1e-6 (8 ulp).


def test_nonzero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.5, 0.5, 0.5000001])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 9, 9, 9])
    keep = nonzero_variance_groups(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False, False, True, True, True]


def test_first_groups_keeps_order_of_appearance():
    g = torch.tensor([5, 5, 2, 2, 8, 8, 1, 1])
    assert first_groups(g, 2).tolist() == [True, True, True, True, False, False, False, False]
    assert first_groups(g, 10).all()


def test_overlong_penalty_hand_computed():
    # L_max 20, L_cache 5: no penalty up to 15 tokens, linear to -1 at 20, -1 beyond
    lens = torch.tensor([10, 15, 16, 18, 20, 25])
    pen = overlong_penalty(lens, max_len=20, buffer=5, penalty=1.0)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0]))
    assert torch.allclose(overlong_penalty(lens, 20, 5, 0.5), pen * 0.5)
    assert torch.all(overlong_penalty(lens, 20, 0) == 0)


# ------------------------------------------------------ the loop's over-sampling (StepParts.rollout)
def _fake_run(reward_rounds, batch_size=3, n=2, oversample=1.0, max_rounds=4):
    """A stand-in for StepParts with a scripted ``_generate``: round k returns groups with the rewards of
    ``reward_rounds[k]`` (one list of n rewards per prompt)."""
    from megaforge.config import load_config

    cfg = load_config(["--config", f"{ROOT}/configs/demo_cpu.yaml", "--algo.dynamic_sampling", "true",
                       "--rollout.batch_size", str(batch_size), "--grpo.n_samples", str(n),
                       "--loop.oversample", str(oversample), "--algo.dynamic_sampling_max_rounds", str(max_rounds)])
    calls = []

    def generate(step, n_prompts, offset, m):
        rewards = reward_rounds[len(calls)]
        calls.append((n_prompts, offset))
        assert n_prompts <= len(rewards)
        out = []
        for i, rs in enumerate(rewards[:n_prompts]):
            for r in rs:
                out.append(Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], rollout_logprobs=[-1.0] * 3,
                                  group_id=offset + i, reward=float(r)))
        m["reward/errors"] = m["reward/timeouts"] = 0.0
        m["reward/math"] = m.get("reward/math", 0.0) + sum(s.reward for s in out)
        return out

    from megaforge.build import RunBuilder

    fake = SimpleNamespace(settings=RunBuilder(cfg).step_settings(), _generate=generate, data=SimpleNamespace(skipped=0, epoch=0),
                           rewards=SimpleNamespace(last_error="", step_errors={}, start_step=lambda: None,
                                                   check_step=lambda step: None), tokenizer=SimpleNamespace(pad_token_id=0),
                           # generation is scripted above; the engine's health hooks are the base no-ops
                           engine=SimpleNamespace(ensure_healthy=lambda: None, health_metrics=lambda: {}))
    return fake, calls


def test_dynamic_sampling_refills_the_batch():
    from megaforge.driver.steps import StepParts

    rounds = [
        [[1, 1], [0, 1], [0, 0], [1, 1]],  # 1 group kept of 3 asked (oversample 1.0 -> 3 prompts)
        [[0, 1], [1, 1], [1, 0]],          # 2 more wanted -> 2 prompts: 1 kept
        [[1, 0], [0, 1]],                  # 1 more wanted -> 1 prompt: kept -> full
    ]
    fake, calls = _fake_run(rounds)
    m = {}
    batch = StepParts.rollout(fake, 1, m, SimpleNamespace(write=lambda s: None))
    assert calls == [(3, 0), (2, 3), (1, 5)]  # group ids continue across rounds
    assert batch.batch_size == 6 and batch.group_ids.tolist() == [1, 1, 3, 3, 5, 5]
    assert batch.rewards.tolist() == [0, 1, 0, 1, 1, 0]
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/kept_groups"] == 3
    assert m["dynamic_sampling/generated_groups"] == 6 and m["dynamic_sampling/fallback"] == 0
    # reward metrics describe everything generated: 12 samples (3 + 2 + 1 prompts x 2), 7 of reward 1
    assert m["reward/mean"] == pytest.approx(7 / 12)
    assert m["reward/math"] == pytest.approx(7 / 12)


def test_dynamic_sampling_bounded_rounds_and_fallback():
    from megaforge.driver.steps import StepParts

    # oversample 2: 3 wanted -> 6 prompts per round; nothing ever has variance; 2 rounds at most
    flat = [[[1, 1]] * 6, [[0, 0]] * 6]
    fake, calls = _fake_run(flat, oversample=2.0, max_rounds=2)
    m = {}
    batch = StepParts.rollout(fake, 1, m, SimpleNamespace(write=lambda s: None))
    assert calls == [(6, 0), (6, 6)]
    assert m["dynamic_sampling/fallback"] == 1 and m["dynamic_sampling/kept_groups"] == 0
    # the step trains on batch_size groups of the last round (advantages will be 0)
    assert batch.group_ids.tolist() == [6, 6, 7, 7, 8, 8]
    # more than enough kept in one round: only the first batch_size groups train
    fake, calls = _fake_run([[[0, 1]] * 6], oversample=2.0)
    batch = StepParts.rollout(fake, 1, {}, SimpleNamespace(write=lambda s: None))
    assert calls == [(6, 0)] and batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
