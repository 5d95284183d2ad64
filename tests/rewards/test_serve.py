"""python -m megaforge.rewards.serve: any megaforge reward over the remote protocol (the built-in
math reward by name, a plug-in), request validation, body bounds, auth and the bind policy."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

from megaforge.config import RewardSpec
from megaforge.rewards import MathReward
from megaforge.rewards.remote import RemoteReward
from service_helpers import ROOT, env, post, serve
from test_executor_units import _alive

CASES = [("What is 2+3?", r"<think>2+3=5</think> \boxed{5}", "5"), ("p", r"\boxed{4}", "5"),
         ("p", r"\boxed{\frac{1}{2}}", "0.5"), ("p", "no answer", "#### 7")]


def test_the_math_reward_by_name_single_and_batched_equal_the_local_one():
    local = [MathReward()(*c) for c in CASES]
    assert local == [1.0, 0.0, 1.0, 0.0]
    with serve("--fn", "math") as (url, _):
        assert [post(url, {"prompt": p, "response": r, "label": t}) for p, r, t in CASES] == \
            [(200, {"reward": v}) for v in local]
        assert post(url, [{"prompt": p, "response": r, "label": t} for p, r, t in CASES]) == \
            (200, [{"reward": v} for v in local])
        # issue 40 case 3: this 17-character answer (an integer of 370 million digits) froze the service
        assert post(url, {"prompt": "p", "response": r"\boxed{9^{9^{9}}}", "label": "5"}) == (200, {"reward": 0.0})
        for batch_size in (0, 3):
            client = RemoteReward(url, batch_size=batch_size)
            try:
                assert client.score_batch(*zip(*CASES)) == local
            finally:
                client.close()


def test_requests_are_validated_naming_the_field_and_bounded():
    with serve("--fn", "math", "--max-body-mb", "0.01", "--max-batch", "3") as (url, _):
        assert post(url, None, raw=b"{not json")[0] == 400
        assert post(url, None, raw=b"{not json")[1]["field"] == "body"
        assert post(url, 5) == (400, {"error": "body: expected an object {prompt, response, label} or a list of them, "
                                               "got int", "field": "body"})
        assert post(url, {"prompt": "p"}) == (400, {"error": "body.response: must be a string (missing)",
                                                    "field": "body.response"})
        assert post(url, {"prompt": 1, "response": "r"})[1]["field"] == "body.prompt"
        assert post(url, [{"prompt": "p", "response": "r"}, "x"]) == \
            (400, {"error": "body[1]: expected an object {prompt, response, label}, got str", "field": "body[1]"})
        assert post(url, [{"prompt": "p", "response": "r"}] * 4)[1]["error"] == \
            "body: 4 samples in one request > --max-batch 3"
        deep = {"prompt": "p", "response": "r", "label": json.loads("[" * 65 + "]" * 65)}
        assert post(url, deep) == (400, {"error": "body: nested deeper than 64 levels", "field": "body"})
        assert post(url, None, raw=b"[" * 4000 + b"]" * 4000) == \
            (400, {"error": "body: nested deeper than 64 levels", "field": "body"})  # was a 500 (RecursionError)
        status, answer = post(url, {"prompt": "p" * 20000, "response": "r"})
        assert status == 413 and answer["field"] == "body"
        assert post(url, {"prompt": "p", "response": r"\boxed{1}", "label": "1"}) == (200, {"reward": 1.0})  # still serving


def test_a_plugin_that_fails_answers_500_or_an_error_entry():
    with serve("--fn", "reward_plugins:raises_on_marker") as (url, _):
        assert post(url, {"prompt": "p", "response": "RAISE"}) == \
            (500, {"error": "ArithmeticError: cannot score this one"})
        assert post(url, [{"prompt": "p", "response": r} for r in ("ab", "RAISE", "INF")]) == \
            (200, [{"reward": 2.0}, {"error": "ArithmeticError: cannot score this one"}, {"error": "ValueError: returned inf"}])
        client = RemoteReward(url, batch_size=0)
        try:
            out = client.score_batch(["p", "p"], ["RAISE", "abc"], [None, None])
        finally:
            client.close()
        assert str(out[0]) == f"{url}: HTTP 500: {{\"error\": \"ArithmeticError: cannot score this one\"}}"
        assert out[1] == 3.0


def test_auth_is_required_when_a_key_is_set_and_the_key_never_shows():
    with serve("--fn", "math", "--api-key-env", "SERVE_TOKEN", extra_env={"SERVE_TOKEN": "tok-123"}) as (url, p):
        body = {"prompt": "p", "response": r"\boxed{2}", "label": "2"}
        assert post(url, body)[0] == 401
        assert post(url, body, token="wrong")[0] == 401
        assert post(url, body, token="tök-123") == (401, {"error": "Unauthorized: the bearer token must be ASCII"})
        assert post(url, body, token="tok-123") == (200, {"reward": 1.0})
        client = RemoteReward.from_spec(RewardSpec("remote", url=url, api_key="tok-123"))
        try:
            assert client.score_batch(["p"], [r"\boxed{2}"], ["2"]) == [1.0]
        finally:
            client.close()
        p.terminate()
        out, err = p.communicate(timeout=10)
        assert "401" in err and "tok-123" not in out + err


def test_binding_beyond_loopback_needs_a_key_and_bad_arguments_are_named():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "megaforge.rewards.serve", *args], env=env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    p = run("--fn", "math", "--host", "0.0.0.0", "--port", "0")
    assert p.returncode != 0 and "--host 0.0.0.0 exposes the reward beyond this machine: give --api-key" in p.stderr
    p = run("--fn", "mth", "--port", "0")
    assert p.returncode != 0 and "unknown reward 'mth'; registered:" in p.stderr
    p = run("--port", "0")
    assert p.returncode != 0 and "give one of --fn NAME and --spec YAML" in p.stderr


def _wait_for(path: str, limit_s: float = 30) -> int:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return int(open(path).read())


def test_every_grade_has_a_deadline_health_answers_meanwhile_and_sigterm_stops_it(tmp_path):
    """Issue 40 case 3: a grade that never ends held the service (no /health) and SIGTERM was ignored.
    Grades run in killable workers: /health answers while one hangs, the grade answers at --timeout-s,
    and a SIGTERM with a grade in flight stops the server and kills its worker."""
    import urllib.request

    with serve("--fn", "reward_plugins:hang_or_length", "--plugins", "reward_plugins", "--timeout-s", "2",
               "--workers", "1") as (url, p):
        answers = []
        started = str(tmp_path / "first")
        t = threading.Thread(target=lambda: answers.append(post(url, {"prompt": "p", "response": "HANG",
                                                                        "label": started})))
        t.start()
        first = _wait_for(started)
        with urllib.request.urlopen(url + "health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"  # while the grade hangs
        t.join(timeout=60)
        assert answers == [(500, {"error": "no result within --timeout-s=2 s of its start"})]
        assert post(url, {"prompt": "p", "response": "abc"}) == (200, {"reward": 3.0})  # a new worker took over
        assert not _alive(first)
        started = str(tmp_path / "second")
        threading.Thread(target=lambda: post(url, {"prompt": "p", "response": "HANG", "label": started}),
                         daemon=True).start()
        second = _wait_for(started)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
        assert not _alive(second)


def test_health_says_broken_once_no_worker_can_be_started(tmp_path):
    import urllib.error
    import urllib.request

    marker = str(tmp_path / "built")
    with serve("--fn", "reward_plugins:CrashOnRebuild", "--kwargs", f"{{marker: {marker}}}", "--plugins",
               "reward_plugins", "--timeout-s", "1", "--workers", "1") as (url, _):
        assert post(url, {"prompt": "p", "response": "ab"}) == (200, {"reward": 2.0})
        status, answer = post(url, {"prompt": "p", "response": "HANG"})  # killed at 1 s; its replacement crashes
        assert status == 500 and answer["error"] in ("no result within --timeout-s=1 s of its start",
                                                     "reward executor: RuntimeError: a restarted reward worker died "
                                                     "while building the rewards (exit status 3)")
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "health", timeout=10).close()
            except urllib.error.HTTPError as e:
                assert e.code == 503 and json.loads(e.read()) == {
                    "status": "broken", "reward": "reward_plugins:CrashOnRebuild",
                    "error": "reward executor: RuntimeError: a restarted reward worker died while building the "
                             "rewards (exit status 3)"}
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
