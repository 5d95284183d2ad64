"""Engine fault tolerance (issue 10, point 1) with real embedded servers over HTTP: kill -9 of an engine
while it generates, a hung (SIGSTOPped) engine, a dead engine found by the health check: each is
restarted, re-synced to the served weight version from the snapshot, and the step's requests are
answered exactly once with the tokens an undisturbed engine gives."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from engine_helpers import buckets_of, engine_config, http, perturbed_state  # noqa: E402
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(400)
VERSION = 3


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory, tokenizer):
    """Two embedded servers; each /generate batch waits 1 s before decoding (--generate-delay), so a
    test can hit it while it runs. A request unanswered after 6 s means a hung engine (an answer takes
about 1.2 s: the 1 s delay and 12 tokens of a tiny model; the SIGSTOP test waits this long)."""
    from megaforge.rollout import build_engine

    cfg = engine_config(tmp_path_factory.mktemp("run"), tiny_model_dir, num_engines=2, max_restarts=2,
                        request_timeout_s=6.0, health_timeout_s=3.0, extra_args=["--generate-delay", "1.0"])
    eng = build_engine(RunBuilder(cfg).engine_spec(), tokenizer)
    _, named = perturbed_state(tiny_model_dir, seed=VERSION)
    eng.update_weights(buckets_of(named, 3), VERSION)
    yield eng
    eng.shutdown()
    assert not any(p.alive() for p in eng.processes)


def _requests(tag: str):
    from megaforge.types import GenerateRequest, SamplingParams

    prompts = [[5, 17, 33, 9], [100, 101], [7, 8, 9, 10, 11], [40], [41, 42, 43], [300, 301, 302, 303, 304, 305],
               [11, 12], [99, 98, 97]]
    return [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=[], seed=1000 + i),
                            rid=f"{tag}-{i}") for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def reference(engine):
    """What the undisturbed engines answer (same requests, seeds and weights)."""
    return engine.generate(_requests("ref"))


def _info(engine, k):
    return http(engine.clients[k].url, "GET", "/server_info")[1]


def _when_running(engine, k, action, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _info(engine, k)["running_requests"] > 0:
            return action()
        time.sleep(0.02)
    raise AssertionError(f"engine_{k} never started generating")


def _generate_in_thread(engine, reqs):
    box = {}

    def run():
        try:
            box["out"] = engine.generate(reqs)
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, box


def _check_answers(out, reqs, reference):
    assert len(out) == len(reqs)
    assert [c.rid for c in out] == [r.rid for r in reqs]  # every request answered, once, in order
    for c, ref in zip(out, reference):
        assert c.weight_version == VERSION
        # seeded (counter-based draws per request and position): regenerated identically
        assert c.finish_reason == "length" and c.output_ids == ref.output_ids
        # a reissued request may share a batch with others (other padding): float32 logprobs can move
        # by an ulp or two (<= 9.5e-7 at |lp| <= 8); 1e-5 covers that, a wrong weight version does not
        assert c.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-5)


def test_kill9_mid_generation_reissues_exactly_once(engine, reference):
    engine.health_metrics()  # reset the counter
    engine.ensure_healthy()
    reqs = _requests("kill")
    served0 = _info(engine, 0)["served_requests"]
    proc = engine.processes[1]
    old_pid, old_port, log = proc.pid, proc.port, proc.log_path
    assert _info(engine, 1)["pid"] == old_pid
    t, box = _generate_in_thread(engine, reqs)
    _when_running(engine, 1, lambda: os.kill(old_pid, signal.SIGKILL))
    t.join(300)
    assert "err" not in box, box.get("err")
    _check_answers(box["out"], reqs, reference)
    # engine_0's half finished before the crash was handled: generated once, not again
    assert _info(engine, 0)["served_requests"] == served0 + len(reqs) // 2
    info = _info(engine, 1)
    assert info["pid"] == proc.pid != old_pid and proc.port == old_port  # same port
    assert info["served_requests"] == len(reqs) // 2  # the re-issued half, once
    assert info["weight_version"] == str(VERSION) and engine.weight_version == VERSION
    assert engine.health_metrics() == {"health/engine_restarts": 1.0}
    text = open(log).read()
    assert f"restart 1 (was pid {old_pid}, port {old_port}): EngineUnreachable" in text
    assert text.count("megaforge.rollout.server --model") == 2  # the log was appended to


def test_sigstopped_engine_times_out_and_is_replaced(engine, reference):
    engine.ensure_healthy()
    reqs = _requests("hung")
    proc = engine.processes[0]
    old_pid = proc.pid
    t, box = _generate_in_thread(engine, reqs)
    t0 = time.time()
    try:
        _when_running(engine, 0, lambda: os.kill(old_pid, signal.SIGSTOP))
        t.join(300)
    finally:
        try:
            os.kill(old_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert "err" not in box, box.get("err")
    assert time.time() - t0 >= 6.0  # found by rollout.request_timeout_s
    _check_answers(box["out"], reqs, reference)
    assert proc.pid != old_pid and not _alive(old_pid)
    assert engine.health_metrics() == {"health/engine_restarts": 1.0}
    assert "no answer within 6 s" in open(proc.log_path).read()


def test_health_check_between_steps_restores_state(engine, reference):
    """An engine hung while idle is found by ensure_healthy (the loop's start-of-step hook) and comes
    back with the served version and the memory state the loop left."""
    engine.ensure_healthy()
    proc = engine.processes[1]
    old_pid = proc.pid
    engine.release_memory(["kv_cache"])
    os.kill(old_pid, signal.SIGSTOP)
    try:
        engine.ensure_healthy()
    finally:
        try:
            os.kill(old_pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert proc.pid != old_pid
    assert _info(engine, 1)["released_memory"] == ["kv_cache"] == _info(engine, 0)["released_memory"]
    engine.resume_memory(["kv_cache"])
    assert engine.weight_version == VERSION
    _check_answers(engine.generate(_requests("after")), _requests("after"), reference)
    assert engine.health_metrics() == {"health/engine_restarts": 1.0}


def test_restart_limit_names_engine_and_log(engine, tiny_model_dir):
    from megaforge.rollout.http.recovery import EngineFailure

    engine.ensure_healthy()
    limit, engine.max_restarts = engine.max_restarts, 0
    proc = engine.processes[0]
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.proc.wait(10)
        with pytest.raises(EngineFailure) as e:
            engine.generate(_requests("limit"))
        msg = str(e.value)
        assert f"engine_0 ({engine.clients[0].url}) failed" in msg and "rollout.max_restarts=0" in msg
        assert f"Its log: {proc.log_path}" in msg and e.value.log_path == proc.log_path
    finally:
        engine.max_restarts = limit
    engine.ensure_healthy()  # within the limit again: back, with the served weights
    assert engine.weight_version == VERSION


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
