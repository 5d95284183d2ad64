import math
import os
import signal
import subprocess
import sys
import time

import pytest

from megaforge.config import RewardsConfig, RewardSpec, config_from_dict
from megaforge.configtree import ConfigError
from megaforge.rewards import MathReward, RewardError, RewardManager, ThinkingReward, last_boxed

TESTS = os.path.dirname(os.path.abspath(__file__))


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
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{9^{9^{9}}}", "5", 0.0),  # issue 40: 370 million digits, graded incorrect unevaluated (it froze)
    (r"\boxed{(10^{6})!}", "5", 0.0),
])
def test_math_reward(response, target, expect):
    assert MathReward()("p", response, target) == expect


def test_answers_are_sized_before_they_are_compared():
    from math_verify import parse

    from megaforge.rewards.verifiers import MAX_ANSWER_DIGITS, answer_digits

    def digits(latex):
        return answer_digits(parse(f"${latex}$", parsing_timeout=None)[0])

    assert digits("9^{9^{9}}") > 3e8 and digits("1^{9^{9^{9}}}") == float("inf") and digits("(10^{6})!") == 6e6
    assert abs(digits("2^{1000}") - 1000 * math.log10(2)) < 1e-9  # 2**1000 has 302 digits
    assert max(digits(a) for a in ("2^{10000}", "e^{-x^{2}}", "\\frac{1}{2}", "\\sqrt{2}", "100!")) < MAX_ANSWER_DIGITS


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


def hang_on_marker(prompt, response, target):
    """Hangs for good (a stuck C call would too: it sleeps without returning) on responses with HANG."""
    if "HANG" in response:
        while True:
            time.sleep(3600)
    return float(len(response))


def die_on_marker(prompt, response, target):
    if "DIE" in response:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash in a C extension, the OOM killer
    return 1.0


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


def _responses(n, marked, marker):
    return [f"{marker} {i}" if i in marked else "x" * (i + 1) for i in range(n)]


def test_hanging_calls_are_killed_and_the_phase_is_bounded():
    """Two calls that never return among 40: decided at rewards.timeout_s, their workers killed and
    replaced; every other sample scored (a spare worker takes the queue while two are stuck); the
    next step is not held up by the stuck calls of this one."""
    m = RewardManager(RewardsConfig(functions=[RewardSpec("test_rewards:hang_on_marker")], timeout_s=3.0, workers=2))
    try:
        responses = _responses(40, {5, 23}, "HANG")
        t = time.monotonic()
        rewards, metrics = m.score(["p"] * 40, responses, ["t"] * 40)
        took = time.monotonic() - t
        assert 3.0 <= took < 6.0, took  # about timeout_s, not n x timeout_s
        assert metrics["reward/timeouts"] == 2 and metrics["reward/errors"] == 0
        assert rewards == [0.0 if "HANG" in r else float(len(r)) for r in responses]
        assert "no result within rewards.timeout_s=3 s" in m.last_error
        assert m.executor.restarts == 2
        t = time.monotonic()
        rewards, metrics = m.score(["p"] * 8, ["ab"] * 8, ["t"] * 8)
        assert rewards == [2.0] * 8 and metrics["reward/timeouts"] == 0 and time.monotonic() - t < 2.5
    finally:
        m.close()


def test_hanging_calls_do_not_starve_the_healthy_ones_of_their_step():
    """Issue 40 case 8: with 2 workers (4 with spares) 4 hanging calls held every worker, the other 4
    calls of the step timed out in the queue and the run stopped. A call's timeout counts from its
    start: the hung workers are killed and replaced at their deadline and the 4 others are scored."""
    m = RewardManager(RewardsConfig(functions=[RewardSpec("test_rewards:hang_on_marker")], timeout_s=1.0, workers=2))
    try:
        responses = ["HANG", "HANG", "a", "bb", "HANG", "HANG", "ccc", "dddd"]  # each chunk handed out starts hanging
        rewards, metrics = m.score(["p"] * 8, responses, ["t"] * 8)
        assert rewards == [0.0 if r == "HANG" else float(len(r)) for r in responses]
        assert metrics["reward/timeouts"] == 4
        m.check_step(1)  # the step goes on
    finally:
        m.close()


def test_many_hanging_calls_do_not_add_up():
    """Every call hangs: after 2 x the largest pool (8) timeouts in a row the rest are not run."""
    m = RewardManager(RewardsConfig(functions=[RewardSpec("test_rewards:hang_on_marker")], timeout_s=0.5, workers=2))
    try:
        t = time.monotonic()
        rewards, metrics = m.score(["p"] * 20, ["HANG"] * 20, ["t"] * 20)
        assert time.monotonic() - t < 10.0 and metrics["reward/timeouts"] == 20 and rewards == [0.0] * 20
        assert m.executor.restarts < 20  # not one round per call
        with pytest.raises(RewardError, match=r"reward 'hang_on_marker' failed on every sample of step 7 \(20 calls: "
                                              r"20 not done within rewards.timeout_s=0.5 s"):
            m.check_step(7)
        m.start_step()
        m.check_step(8)  # nothing scored since: nothing to report
    finally:
        m.close()


def test_a_crashing_worker_fails_only_its_call():
    m = RewardManager(RewardsConfig(functions=[RewardSpec("test_rewards:die_on_marker")], timeout_s=20.0, workers=2))
    try:
        rewards, metrics = m.score(["p"] * 6, _responses(6, {2}, "DIE"), ["t"] * 6)
        assert rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0] and metrics["reward/errors"] == 1
        assert "the reward worker died in this call (exit status -9)" in m.last_error
        m.check_step(1)  # not every sample failed
    finally:
        m.close()


@pytest.mark.parametrize("value", [0, -1, -0.5])
def test_timeout_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"config key 'rewards.timeout_s': must be > 0"):
        config_from_dict({"model": {"config": "x"}, "data": {"path": "x"}, "rewards": {"timeout_s": value}})


def test_the_process_exits_promptly_with_a_call_still_stuck(tmp_path):
    """The old thread pool kept the interpreter waiting on the stuck thread at exit (forever): a
    script that scores one hanging call and ends must end, and a SIGTERM must end it too. (The
    script has no ``if __name__ == "__main__"`` guard: the workers do not re-import it.)"""
    script = (
        "import sys, time\n"
        "from megaforge.config import RewardsConfig, RewardSpec\n"
        "from megaforge.rewards import RewardManager\n"
        "m = RewardManager(RewardsConfig(functions=[RewardSpec('test_rewards:hang_on_marker')], timeout_s=1.0, workers=1))\n"
        "print(m.score(['p'], ['HANG'], ['t'])[1]['reward/timeouts'], flush=True)\n"
        "m.executor.submit([m._call(0, 'p', 'HANG', 't')])  # left running: the end must not wait for it\n"
        "if sys.argv[1] == 'wait':\n"
        "    time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS), TESTS]))
    t = time.monotonic()
    (tmp_path / "score.py").write_text(script)
    out = subprocess.run([sys.executable, str(tmp_path / "score.py"), "end"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "1.0", out.stderr[-2000:]
    assert time.monotonic() - t < 30
    p = subprocess.Popen([sys.executable, "-c", script, "wait"], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "1.0"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == -signal.SIGTERM
