"""The rank watchdog over a real TCPStore (megaforge.cluster): a reported failure ends the other ranks
after the grace period, a silent rank is detected by its stale heartbeat, a finished rank is not,
and torchrun's variables give the node layout."""
import datetime
import time

import pytest
import torch.distributed as tdist

from megaforge.cluster import Job, Watchdog, _key, place_from_env


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store():
    port = free_port()
    master = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=10))
    yield lambda: tdist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    del master


def _dog(store, rank, world=2, **kw):
    ended = []
    args = dict(heartbeat_s=0.1, peer_timeout_s=1.0, abort_grace_s=0.5)
    args.update(kw)
    d = Watchdog(store(), rank, world, exit_fn=lambda r, why: ended.append((time.monotonic(), why)), **args)
    return d, ended


def test_reported_failure_ends_the_others_after_the_grace(store):
    a, ended_a = _dog(store, 0)
    b, ended_b = _dog(store, 1)
    a.start(), b.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    b.report("RuntimeError: boom")
    b.stop(done=False)
    deadline = t0 + 3.0
    while not ended_a and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended_a, "rank 0 was not ended"
    took = ended_a[0][0] - t0
    assert 0.5 <= took < 1.5, took  # abort_grace_s, plus at most a couple of periods
    assert "rank 1: RuntimeError: boom" in ended_a[0][1] and "abort_grace_s" in ended_a[0][1]
    assert not ended_b


def test_silent_rank_is_detected_and_finished_rank_is_not(store):
    a, ended_a = _dog(store, 0, world=3)
    b, _ = _dog(store, 1, world=3)
    c, ended_c = _dog(store, 2, world=3)
    a.start(), b.start(), c.start()
    time.sleep(0.3)
    b.stop(done=True)  # rank 1 finished normally: its heartbeat stops on purpose
    time.sleep(1.6)
    assert not ended_a and not ended_c
    c._stop.set()  # rank 2 goes silent without saying so (a hung or killed process)
    t0 = time.monotonic()
    while not ended_a and time.monotonic() < t0 + 3.0:
        time.sleep(0.05)
    assert ended_a and "rank 2 sent no heartbeat" in ended_a[0][1]
    assert ended_a[0][0] - t0 < 1.0 + 0.5
    a.stop()


def test_place_from_env():
    p = place_from_env({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (p.node, p.nodes, p.node_leader) == (1, 2, False)
    assert place_from_env({}).world == 1
    with pytest.raises(RuntimeError, match="not a multiple"):
        place_from_env({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})


def test_the_job_holds_its_watchdog_stops_its_parts_then_says_done(store):
    # What megaforge.launch does at the end of a run, on the Job it holds (no process-wide state): the
    # parts registered with at_end (node engines) stop first, last registered first, while the watchdog
    # still watches; then the watchdog stops and tells the others this rank finished.
    job, other = Job(), store()
    job.watchdog, _ = _dog(store, 0)
    job.watchdog.start()
    seen = []
    job.at_end(lambda together: seen.append(("first", together, other.check([_key("done/0")]))))
    job.at_end(lambda together: seen.append(("second", together, other.check([_key("done/0")]))))
    job.end(together=True)
    assert seen == [("second", True, False), ("first", True, False)]
    assert other.check([_key("done/0")]) and job.watchdog is None
    job.end(together=True)  # a second end has nothing left to do
    assert len(seen) == 2


def test_a_failing_job_reports_and_does_not_say_done(store):
    job, other = Job(), store()
    job.watchdog, _ = _dog(store, 1)
    job.watchdog.start()
    job.report_failure(ValueError("bad row 3\nsecond line"))
    job.end(together=False)
    assert other.get(_key("failed")) == b"rank 1: ValueError: bad row 3"
    assert not other.check([_key("done/1")])
    Job().report_failure(RuntimeError("no watchdog: one process"))  # nothing to tell, no error
