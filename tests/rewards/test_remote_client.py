"""The remote reward client against real HTTP servers on 127.0.0.1: slime's single form, the batched
form, bearer auth, retries with back-off, timeouts, and every kind of bad answer, each failing only
its samples with a message naming the URL and the problem."""
import json
import socket
import time
import urllib.request

import pytest

from megaforge.config import RewardsConfig, RewardSpec
from megaforge.rewards import RewardError, RewardManager
from megaforge.rewards.remote import RemoteReward, RewardServiceError, RewardServiceTimeout
from service_helpers import bad_server


@pytest.fixture(scope="module")
def bad():
    with bad_server() as (url, _):
        yield url


def scores(url, responses, **kw):
    r = RemoteReward(url, **kw)
    try:
        return r.score_batch(["p"] * len(responses), responses, [None] * len(responses))
    finally:
        r.close()


def test_single_form_concurrent_and_every_bad_answer_fails_alone(bad):
    out = scores(bad, ["ab", "500", "junk", "shape", "nan", "string", "abcd"], max_concurrency=4)
    assert out[0] == 2.0 and out[6] == 4.0
    msgs = [str(e) for e in out[1:6]]
    assert all(isinstance(e, RewardServiceError) for e in out[1:6])
    assert msgs[0] == f"{bad}: HTTP 500: Internal Server Error: model crashed"
    assert msgs[1] == f"{bad}: answered non-JSON (HTTP 200): '<html>oops</html>'"
    assert msgs[2] == f"{bad}: answered an object without 'reward': {{\"score\": 1}}"
    assert msgs[3] == f"{bad}: answered a non-finite reward nan"
    assert msgs[4] == f"{bad}: answered 0.5, not a number or {{\"reward\": number}}"


def test_batched_form_and_its_bad_answers(bad):
    assert scores(bad, ["a", "bb", "ccc", "dddd", "e"], batch_size=2) == [1.0, 2.0, 3.0, 4.0, 1.0]
    short = scores(bad, ["short-list", "x", "y"], batch_size=8)
    assert [str(e) for e in short] == [f"{bad}: answered a list of 2 rewards for 3 samples"] * 3
    obj = scores(bad, ["object", "x"], batch_size=8)
    assert str(obj[0]).startswith(f"{bad}: answered dict ") and str(obj[0]).endswith("to a batch of 2, not a list")
    errs = scores(bad, ["errors", "x", "y", "z"], batch_size=8)
    assert errs[0] == 0.0 and errs[2] == 2.0
    assert str(errs[1]) == f"{bad} (entry 1): the service failed this sample: cannot score"


def test_retries_with_backoff_on_dropped_connections_and_503(bad):
    t = time.monotonic()
    assert scores(bad, ["flaky-503", "flaky-drop"], retries=3, backoff_s=0.1) == [0.75, 0.75]
    assert time.monotonic() - t >= 0.1 + 0.2  # two failed attempts each: back-off 0.1 s, then 0.2 s
    out = scores(bad, ["flaky-x"], retries=0)  # a fresh text: its first request drops, and is not retried
    assert isinstance(out[0], RewardServiceError) and "unreachable after 1 attempt(s)" in str(out[0])


def test_answers_are_bounded_redirects_refused_and_bad_entries_fail_alone(bad):
    """Issue 40 case 4: a 3,000 MiB answer was read whole past request_timeout_s, a redirect to another
    host was followed (re-posting the sample there), and a 401-digit integer failed the whole batch."""
    out = scores(bad, ["endless", "trickle", "redirect", "ab"], max_response_mb=1, request_timeout_s=1.5, retries=0)
    assert str(out[0]) == f"{bad}: answered more than max_response_mb=1 MiB"
    assert isinstance(out[1], RewardServiceTimeout)  # headers at once, then a byte per 0.2 s: the deadline holds
    assert str(out[1]) == f"{bad}: no answer within request_timeout_s=1.5 s"
    assert str(out[2]) == f"{bad}: HTTP 307 redirect to {bad}elsewhere: redirects are not followed"
    assert out[3] == 2.0
    batch = scores(bad, ["huge-values", "x", "y", "z", "abcd"], batch_size=8)
    assert batch[0] == 11.0 and batch[4] == 4.0
    assert [str(e) for e in batch[1:4]] == [
        f"{bad} (entry 1): answered an integer of 1333 bits, beyond the reward bound 1e+06",
        f"{bad} (entry 2): answered 1e+300, beyond the reward bound [-1e+06, 1e+06]",
        f"{bad} (entry 3): answered true, not a number or {{\"reward\": number}}"]


def test_a_service_that_is_down_is_retried_then_named():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    t = time.monotonic()
    (e,) = scores(url, ["a"], retries=2, backoff_s=0.1)
    assert time.monotonic() - t >= 0.1 + 0.2
    assert isinstance(e, RewardServiceError)
    assert str(e).startswith(f"{url}: unreachable after 3 attempt(s): ClientConnectorError")


def test_a_slow_service_times_out(bad):
    t = time.monotonic()
    out = scores(bad, ["slow", "ab"], request_timeout_s=0.5)
    assert time.monotonic() - t < 2.5
    assert isinstance(out[0], RewardServiceTimeout) and isinstance(out[0], TimeoutError)
    assert str(out[0]) == f"{bad}: no answer within request_timeout_s=0.5 s" and out[1] == 2.0


def test_bearer_token_sent_and_never_shown(bad, monkeypatch):
    monkeypatch.setenv("TEST_RM_TOKEN", "s3cret-token")
    r = RemoteReward.from_spec(RewardSpec("remote", url=bad, api_key_env="TEST_RM_TOKEN"))
    try:
        out = r.score_batch(["p", "p"], ["ab", "500"], [None, None])
        assert out[0] == 2.0 and "s3cret" not in str(out[1]) and "s3cret" not in repr(r)
    finally:
        r.close()
    with urllib.request.urlopen(bad + "seen", timeout=10) as resp:
        assert json.loads(resp.read())["authorization"] == "Bearer s3cret-token"
    monkeypatch.delenv("TEST_RM_TOKEN")
    with pytest.raises(ValueError, match="api_key_env names the environment variable 'TEST_RM_TOKEN', which is not set"):
        RemoteReward.from_spec(RewardSpec("remote", url=bad, api_key_env="TEST_RM_TOKEN"))


def test_through_the_manager_failures_are_counted_and_a_dead_service_stops_the_step(bad):
    """In the reward workers: timeouts and errors counted per sample, the last message names the URL;
    a service failing every sample of a step raises RewardError naming it."""
    spec = RewardSpec("remote", url=bad, batch_size=0, request_timeout_s=0.5, retries=0)
    m = RewardManager(RewardsConfig(functions=[spec], timeout_s=10.0, workers=1))
    try:
        totals, metrics = m.score(["p"] * 4, ["ab", "slow", "junk", "abc"], [None] * 4)
        assert totals == [2.0, 0.0, 0.0, 3.0]
        assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 1 and metrics["reward/remote"] == 1.25
        m.check_step(1)
        m.start_step()
        m.score(["p"] * 3, ["500"] * 3, [None] * 3)
        with pytest.raises(RewardError, match=f"reward 'remote' failed on every sample of step 2 .*last: reward 'remote' "
                                              f"failed on sample 2: RewardServiceError: {bad}: HTTP 500"):
            m.check_step(2)
    finally:
        m.close()
