import time

import pytest

from megaforge.config import RewardsConfig, RewardSpec
from megaforge.rewards import MathReward, RewardManager, ThinkingReward, last_boxed


def test_last_boxed_nested():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no box") is None


@pytest.mark.parametrize("response,target,expect", [
    (r"<think>2+2=4</think> \boxed{4}", "4", 1.0),
    (r"\boxed{5}", "4", 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"so #### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    (r"\boxed{72}", "#### 72", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),  # math-verify equivalence
    (r"\boxed{x+1}", "1+x", 1.0),
    ("no answer", "3", 0.0),
])
def test_math_reward(response, target, expect):
    assert MathReward()("p", response, target) == expect


@pytest.mark.parametrize("response,expect", [
    (r"<think>3+4=7</think> \boxed{7}", 1.0),
    (r"<think></think> \boxed{7}", 0.0),
    (r"\boxed{7}", 0.0),
    (r"<think>a</think> <think>b</think> \boxed{7}", 0.0),
    (r"<think>a</think> seven", 0.0),
])
def test_thinking_reward(response, expect):
    assert ThinkingReward()("p", response) == expect


def slow_reward(prompt, response, target):
    time.sleep(5)
    return 1.0


def raising_reward(prompt, response, target):
    raise ZeroDivisionError("boom")


def scaled_reward(prompt, response, target, scale=1.0):
    return scale * len(response)


def test_manager_weights_plugins_timeouts_errors():
    cfg = RewardsConfig(functions=[
        RewardSpec("math", 0.5), RewardSpec("test_rewards:scaled_reward", 1.0, {"scale": 2.0}),
    ])
    m = RewardManager(cfg)
    rewards, metrics = m.score(["p", "p"], [r"\boxed{3}", "ab"], ["3", "3"])
    assert rewards == [0.5 + 2.0 * len(r"\boxed{3}"), 0.0 + 2.0 * 2]
    assert metrics["reward/math"] == 0.5

    bad = RewardManager(RewardsConfig(functions=[RewardSpec("test_rewards:slow_reward"), RewardSpec("test_rewards:raising_reward")], timeout_s=0.2))
    t = time.time()
    rewards, metrics = bad.score(["p"], ["r"], ["t"])
    assert time.time() - t < 3 and rewards == [0.0]
    assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 1
    assert "ZeroDivisionError: boom" in bad.last_error


def test_unknown_reward_lists_registered():
    # other tests may register rewards of their own in this process: check ours are listed
    with pytest.raises(ValueError, match=r"unknown reward 'mth'; registered: (\w+, )*math, (\w+, )*thinking"):
        RewardManager(RewardsConfig(functions=[RewardSpec("mth")]))
    with pytest.raises(ValueError, match="cannot import module 'nope'"):
        RewardManager(RewardsConfig(functions=[RewardSpec("nope:fn")]))
