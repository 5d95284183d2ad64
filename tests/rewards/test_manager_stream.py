"""RewardManager: pools of their own, labels, group-level rewards and streams (samples added as they
are generated, scored while the rest is generated)."""
import time

import pytest

from megaforge.config import RewardsConfig, RewardSpec
from megaforge.rewards import RewardError, RewardManager

import reward_plugins  # noqa: F401  (registers the test rewards here too: the manager checks names)


def manager(*specs, **kw):
    return RewardManager(RewardsConfig(functions=list(specs), **kw), plugins=["reward_plugins"])


def test_group_level_rewards_get_each_group_and_weights_add_up():
    m = manager(RewardSpec("test_length_rank", 2.0), RewardSpec("reward_plugins:length", 1.0))
    try:
        responses = ["ccc", "a", "bb", "xx", "y"]
        totals, metrics = m.score(["p0"] * 3 + ["p1"] * 2, responses, ["t0"] * 3 + ["t1"] * 2, [7, 7, 7, 8, 8])
        ranks = [2.0, 0.0, 1.0, 1.0, 0.0]
        assert totals == [2.0 * r + len(s) for r, s in zip(ranks, responses)]
        assert metrics["reward/test_length_rank"] == sum(ranks) / 5 and metrics["reward/errors"] == 0
        with pytest.raises(ValueError, match="'test_length_rank' is group-level: scoring needs the samples' group ids"):
            m.score(["p"], ["r"], ["t"])
        s = m.stream()
        s.add(["p"], ["r"], ["t"], [3])
        with pytest.raises(ValueError, match="group 3 was already added to this reward phase"):
            s.add(["p"], ["q"], ["t"], [3])
        with pytest.raises(ValueError, match="group 4: its samples have different prompts or targets"):
            m.score(["p", "q"], ["r", "r"], ["t", "t"], [4, 4])
    finally:
        m.close()


def test_a_plugin_path_declares_group_level_by_attribute():
    m = manager(RewardSpec("reward_plugins:group_mean_centered"))
    try:
        assert m.levels == ["group"]
        totals, _ = m.score(["p"] * 4, ["a", "bbb", "cc", "cccc"], ["t"] * 4, [0, 0, 1, 1])
        assert totals == [-1.0, 1.0, -1.0, 1.0]
    finally:
        m.close()


def test_a_failing_group_reward_fails_every_sample_of_the_group():
    m = manager(RewardSpec("test_group_wrong_length"))
    try:
        totals, metrics = m.score(["p"] * 3, ["a", "b", "c"], ["t"] * 3, [0, 0, 0])
        assert totals == [0.0] * 3 and metrics["reward/errors"] == 3
        assert m.last_error.startswith("reward 'test_group_wrong_length' failed on group 0 (samples 0..2): ValueError: "
                                       "a group-level reward must return a list of 3 numbers")
        with pytest.raises(RewardError, match="failed on every sample of step 1 \\(3 calls"):
            m.check_step(1)
    finally:
        m.close()


def test_labels_pools_and_per_reward_messages():
    m = manager(RewardSpec("reward_plugins:length", label="a"), RewardSpec("reward_plugins:times_out", label="b", workers=1))
    try:
        assert len(m.pools) == 2 and m.pools[1].spares is False  # b has a pool of its own, without spares
        totals, metrics = m.score(["p"] * 2, ["x", "yy"], ["t"] * 2)
        assert totals == [1.0, 2.0] and metrics["reward/a"] == 1.5 and metrics["reward/b"] == 0.0
        assert metrics["reward/timeouts"] == 2
        assert m.step_errors == {"b": "reward 'b' (reward_plugins:times_out) failed on sample 1: TimeoutError: "
                                      "service did not answer within 0.1 s"}
        m.start_step()
        assert m.step_errors == {}
    finally:
        m.close()
    with pytest.raises(ValueError, match="reward label 'length' is used twice"):
        manager(RewardSpec("reward_plugins:length"), RewardSpec("reward_plugins:length"))


def test_a_stream_scores_what_was_added_while_the_rest_is_generated():
    """Samples added in three parts with 0.5 s of 'generation' between them: the first parts are
    scored during the gaps (outcomes decided before the next add), the results equal scoring all at
    once, and time/reward (the span) exceeds time/reward_wait (what was left after generation)."""
    m = manager(RewardSpec("reward_plugins:slow_length"), workers=2)
    try:
        parts = [["a", "bb", "ccc", "dddd"], ["e", "ff", "ggg", "hhhh"], ["i", "jj", "kkk", "llll"]]
        s = m.stream()
        adds = []
        for k, part in enumerate(parts):
            adds.append(time.monotonic())
            s.add(["p"] * 4, part, ["t"] * 4, [k] * 4)
            if k < 2:
                time.sleep(0.5)  # the engine generating the next part
        first_decided = max(o.at for o in m.pools[0]._done.values())  # decided, not yet collected
        totals, metrics = s.finish()
        assert totals == [float(len(r)) for part in parts for r in part]
        assert first_decided < adds[2]  # the first parts were scored before the last one was added
        # 4 calls of 0.15 s on 2 workers: 0.3 s after the last add (timer slack: 2x)
        assert metrics["time/reward_wait"] < 0.6 < 1.0 < metrics["time/reward"]
        assert m.score(["p"] * 12, [r for part in parts for r in part], ["t"] * 12)[0] == totals
    finally:
        m.close()
