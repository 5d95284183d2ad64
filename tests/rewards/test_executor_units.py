"""RewardExecutor units: batched rewards scored as batches, group-level calls, per-call
timeouts reported by a reward, and the decision times that measure a reward phase."""
import os
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
        assert 1.5 <= took < 8.0, took
        # the second batch starts on the replacement worker: its timeout counts from then
        assert [o.timed_out for o in out] == [True, True, True, False] and out[3].value == 1.0
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


def test_reward_values_are_real_finite_numbers_within_the_bound():
    """Issue 40: "0.75" and True were accepted as 0.75 and 1.0, 1e300 was taken (and logged as 1e308)."""
    ex = executor(RewardSpec("reward_plugins:value_of"))
    try:
        kinds = ["int", "negative", "numpy", "bound", "str", "bool", "none", "big", "hugeint", "inf"]
        out = ex.collect(ex.submit([RewardCall(0, "p", k, "t") for k in kinds]))
        assert [o.value for o in out[:4]] == [3.0, -2.5, 0.5, 1e6]
        assert [o.error for o in out[4:]] == [
            "ValueError: returned str '0.75', not a number (rewards are real numbers: strings and bools are refused)",
            "ValueError: returned bool True, not a number (rewards are real numbers: strings and bools are refused)",
            "ValueError: returned NoneType None, not a number (rewards are real numbers: strings and bools are refused)",
            "ValueError: returned 1e+300, beyond the reward bound [-1e+06, 1e+06]",
            "ValueError: returned an integer of 1329 bits, beyond the reward bound 1e+06",
            "ValueError: returned inf"]
    finally:
        ex.close()


def test_calls_queued_behind_hanging_ones_are_all_scored():
    """Issue 40 case 8: 4 hanging calls of 64 on 2 workers zeroed healthy ones whose timeout ran while
    they waited in the queue. A call's timeout counts from its start: each hanging call times out,
    its worker is killed and replaced, and every healthy call is scored."""
    ex = executor(RewardSpec("reward_plugins:hang_or_length"), workers=2, timeout_s=1.0)
    try:
        hang = {0, 1, 32, 48}  # the first call of each chunk handed out: every worker and spare is stuck at once
        responses = ["HANG" if i in hang else "x" * (i % 7 + 1) for i in range(64)]
        out = ex.collect(ex.submit([RewardCall(0, "p", r, "t") for r in responses]))
        assert [i for i, o in enumerate(out) if o.timed_out] == sorted(hang)
        assert all(o.value == len(r) for o, r in zip(out, responses) if r != "HANG")
        assert out[0].error == "no result within rewards.timeout_s=1 s of its start"
    finally:
        ex.close()


def test_a_reward_that_hangs_on_everything_is_given_up_after_some_timeouts_in_a_row():
    ex = executor(RewardSpec("reward_plugins:hang_or_length"), timeout_s=0.5, spares=False, give_up_after=2)
    try:
        out = ex.collect(ex.submit([RewardCall(0, "p", "HANG", "t") for _ in range(10)]))
        assert all(o.timed_out for o in out) and ex.restarts == 2
        assert [o.error.split(":")[0] for o in out] == ["no result within rewards.timeout_s=0.5 s of its start"] * 2 + \
            ["not run"] * 8
        assert out[2].error == "not run: the last 2 calls of this reward timed out (rewards.timeout_s=0.5 s) without " \
                               "one finishing"
        assert [o.value for o in ex.collect(ex.submit([RewardCall(0, "p", "ab", "t")]))] == [2.0]  # later calls run
    finally:
        ex.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, waiting for its reaper
    except OSError:
        return False


def test_a_daemon_started_by_a_reward_dies_with_the_pool(tmp_path):
    """Issue 40 case 7: a double-forked, setsid'd child of a reward worker outlived the run (workers
    were killed by process group only). The worker is a child subreaper and is killed with its tree."""
    pidfile = str(tmp_path / "daemon.pid")
    ex = executor(RewardSpec("reward_plugins:leaves_a_daemon"))
    try:
        assert [o.value for o in ex.collect(ex.submit([RewardCall(0, "p", "r", pidfile)]))] == [1.0]
        pid = int(open(pidfile).read())
        assert _alive(pid) and os.getsid(pid) != os.getsid(ex._workers[0].proc.pid)  # a session of its own
    finally:
        ex.close()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_replacement_worker_that_cannot_start_stops_the_executor_naming_it(tmp_path):
    """Queued calls have no deadline until they start: a replacement that dies while building the
    rewards must not leave them waiting on replacements of replacements."""
    ex = executor(RewardSpec("reward_plugins:CrashOnRebuild", kwargs={"marker": str(tmp_path / "built")}),
                  timeout_s=0.5, spares=False)
    try:
        ids = ex.submit([RewardCall(0, "p", "HANG", "t"), RewardCall(0, "p", "ab", "t")])
        with pytest.raises(RuntimeError, match=r"a restarted reward worker died while building the rewards "
                                               r"\(exit status 3\)"):
            ex.collect(ids)
    finally:
        ex.close()
