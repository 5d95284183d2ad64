"""RewardExecutor units: batched rewards scored as batches, group-level calls, per-call
timeouts reported by a reward, and the decision times that measure a reward phase."""
import time

import pytest

from megaforge.config import RewardSpec
from megaforge.rewards import build_reward
from megaforge.rewards.executor import RewardCall, RewardExecutor


def executor(*specs, levels=None, workers=1, timeout_s=20.0, **kw):
    return RewardExecutor(build_reward, list(specs), workers, timeout_s, plugins=["reward_plugins"], levels=levels, **kw)


def test_a_batched_reward_is_scored_in_batches_of_its_size_with_per_call_failures():
    ex = executor(RewardSpec("test_batch_size", kwargs={"batch_size": 4}), RewardSpec("reward_plugins:length"))
    try:
        assert ex.batch_sizes == [4, 0]
        responses = ["a", "BAD", "c", "NAN", "e", "f", "g", "h", "i", "j"]
        ids = ex.submit([RewardCall(0, "p", r, "t") for r in responses] + [RewardCall(1, "p", "xyz", "t")])
        out = ex.collect(ids)
        # one worker: batches of 4, 4 and 2 (the unbatched call goes in a chunk of its own)
        assert [o.value for o in out] == [4.0, None, 4.0, None, 4.0, 4.0, 4.0, 4.0, 2.0, 2.0, 3.0]
        assert out[1].error == "KeyError: 'bad sample'" and out[3].error == "ValueError: returned nan"
        assert not any(o.timed_out for o in out)
    finally:
        ex.close()


def test_a_batch_of_the_wrong_length_fails_every_call_of_it():
    ex = executor(RewardSpec("reward_plugins:WrongLength", kwargs={"batch_size": 8}))
    try:
        out = ex.collect(ex.submit([RewardCall(0, "p", r, "t") for r in "abc"]))
        assert all(o.value is None and o.error == "ValueError: score_batch returned list 4 for 3 calls" for o in out)
    finally:
        ex.close()


def test_a_hanging_batch_times_out_as_a_whole_and_its_worker_is_replaced():
    ex = executor(RewardSpec("test_batch_size", kwargs={"batch_size": 3}), timeout_s=1.5, spares=False)
    try:
        t = time.monotonic()
        out = ex.collect(ex.submit([RewardCall(0, "p", r, "t") for r in ["a", "HANG", "c", "d"]]))
        took = time.monotonic() - t
        assert 1.5 <= took < 4.0, took
        assert [o.timed_out for o in out] == [True, True, True, True]  # the second batch waited past its deadline
        assert ex.restarts == 1 and len(ex._workers) == 1  # no spare worker for a stalled batch with spares off
        assert [o.value for o in ex.collect(ex.submit([RewardCall(0, "p", "z", "t")]))] == [1.0]
    finally:
        ex.close()


def test_group_level_calls_return_one_value_per_response():
    ex = executor(RewardSpec("test_length_rank"), RewardSpec("test_group_wrong_length"), levels=["group", "group"])
    try:
        out = ex.collect(ex.submit([RewardCall(0, "p", ["ccc", "a", "bb"], "t"), RewardCall(1, "p", ["a", "b"], "t")]))
        assert out[0].value == [2.0, 0.0, 1.0]
        assert out[1].value is None and "must return a list of 2 numbers (one per response), got list 1" in out[1].error
    finally:
        ex.close()


def test_a_timeout_error_of_the_reward_is_a_timed_out_outcome():
    ex = executor(RewardSpec("reward_plugins:times_out"))
    try:
        (o,) = ex.collect(ex.submit([RewardCall(0, "p", "r", "t")]))
        assert o.timed_out and o.value is None and o.error == "TimeoutError: service did not answer within 0.1 s"
    finally:
        ex.close()


def test_outcomes_record_when_they_were_decided():
    ex = executor(RewardSpec("reward_plugins:slow_length"))
    try:
        t0 = time.monotonic()
        out = ex.collect(ex.submit([RewardCall(0, "p", r, "t") for r in ["a", "bb", "ccc"]]))
        ats = [o.at for o in out]
        assert t0 < ats[0] < ats[1] < ats[2] <= time.monotonic()  # one worker: one after the other
        assert ats[2] - ats[0] >= 2 * 0.15 * 0.9  # two sleeps of 0.15 s between the first and last (10%: timer slack)
    finally:
        ex.close()


def test_levels_are_checked():
    with pytest.raises(ValueError, match="levels must be 'sample' or 'group' per spec"):
        executor(RewardSpec("math"), levels=["batch"])
