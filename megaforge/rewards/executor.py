"""Reward calls in worker processes, where a stuck call can be killed: the execution layer under
:class:`megaforge.rewards.RewardManager` (and the place for remote reward services / LLM judges).

    ex = RewardExecutor(build_reward, specs, workers=4, timeout_s=30)
    ids = ex.submit([RewardCall(0, prompt, response, target), ...])   # as samples arrive
    outcomes = ex.collect(ids)     # [RewardOutcome(value, error, timed_out)], in the order of ids
    ex.close()

* Workers: ``workers`` fresh interpreters (``python -c``: not ``fork``, the trainer holds threads
  and devices; not multiprocessing's ``spawn``, which re-imports the trainer's ``__main__``). Each
  takes the trainer's ``sys.path``, imports the plug-in modules, then builds every reward once
  with ``build(spec)`` (a module-level function, e.g. :func:`megaforge.rewards.build_reward`); a
  build error is raised by the constructor as ``ValueError`` with the worker's message. A worker
  runs in a session (process group) of its own and dies with the trainer (``PR_SET_PDEATHSIG``).
* Process trees: a worker is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so whatever its reward
  starts stays below it even when it double-forks and calls ``setsid`` (an orphan is re-parented to
  the worker, not to init). A worker is killed with its whole tree (:func:`kill_tree`: the tree,
  read from ``/proc``, is stopped with SIGSTOP until no new process appears, then killed with
  SIGKILL), at a deadline, when it died, and in :meth:`RewardExecutor.close`: nothing a reward
  started outlives the pool.
* Dispatch: queued calls go to idle workers in chunks of up to ``chunk`` calls (one message for
  many cheap calls: the math reward takes ~0.1 ms); each result comes back on its own, in order, so
  the call a worker is running is always known. A chunk is a list of *units* run one after the
  other: a single call, or a *batch*: up to ``batch_size`` calls of one batched reward (an object
  with ``score_batch(prompts, responses, targets) -> list`` and a ``batch_size`` attribute >= 1,
  e.g. a reward model's forward or a service's batched request; its list holds a number or an
  Exception per call) run as one; a chunk holding a batch holds nothing else. The calls of a batch
  start, and time out, together.
* Group-level rewards (``levels[fn] == "group"``): a call's ``response`` is the list of the
  group's responses, the reward returns one number per response, and the outcome's ``value`` is
  that list (all finite, of the right length, or the call fails).
* Deadline: a call must finish within ``timeout_s`` of the moment a worker starts it (time in the
  queue does not count: calls queued behind hanging ones are not starved). At the deadline the
  call times out; the worker running it is killed with its process tree and replaced, and the calls
  of its chunk it had not started go back to the front of the queue. A phase in which H calls hang
  lasts about ``ceil(H / pool size) * timeout_s`` (plus the replacements' start-up).
* Giving up: after ``give_up_after`` calls of one reward in a row timed out (none finished in
  between; default twice the largest pool, ``2 * 2 * workers`` with spares), the calls of that
  reward still queued time out at once without running ("not run: ..."), so a reward that hangs on
  everything costs a phase about two rounds of ``timeout_s``, not one per call. Calls submitted
  later run again.
* Stalls: a call running longer than ``timeout_s / 10`` may hang, so the calls of its chunk it has
  not started go to other workers, and while no worker is free a spare one starts (at most twice
  ``workers`` in all): a few hanging calls do not take the rest of the step with them. The first
  outcome of a call counts.
* A worker that dies in a call (a crash, the OOM killer) fails that call naming its exit status
  and is replaced; so is one killed at a deadline (``restarts`` counts both), up to ``workers``.
* A thread of the executor (the pump) dispatches queued calls as workers free up and reads results
  as they arrive, so calls submitted while the caller goes on (generating more samples) are scored
  meanwhile; :meth:`collect` only waits.
* :meth:`close` kills the workers at once: nothing waits on a stuck call at the end of a run.

A reward value must be a real finite number within the bound of :mod:`megaforge.rewards.values`
(strings and bools refused); anything else, or an exception, is an error outcome carrying
``"ExcType: message"``; a ``TimeoutError`` (e.g. a service's per-request
timeout) is a timed-out outcome. Every outcome records when it was decided (``at``, monotonic
seconds): a reward phase that overlaps generation measures its span from these.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import multiprocessing.connection as mpc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megaforge.rewards.proctree import kill_tree


@dataclass(frozen=True)
class RewardCall:
    fn: int  # index of the reward in the executor's specs
    prompt: str
    response: Any  # str; for a group-level reward the list of the group's responses
    target: Any


@dataclass
class RewardOutcome:
    value: Any = None  # float; a list of floats for a group-level call; None when it failed
    error: str = ""  # "ExcType: message" when the call raised or returned a non-finite / non-number
    timed_out: bool = False
    at: float = 0.0  # time.monotonic() when it was decided

    @property
    def ok(self) -> bool:
        return self.value is not None


class _Worker:
    """One worker process, started from an argument list (not multiprocessing's spawn, which would
    re-import the trainer's ``__main__``), in a session of its own, with two pipes."""

    def __init__(self, init: bytes):
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = ("import sys; sys.path.insert(0, sys.argv[3]); "
                "from megaforge.rewards.worker import worker_entry; worker_entry()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(from_parent), str(to_parent), root],
                                     pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(from_parent)
        os.close(to_parent)
        self.out = mpc.Connection(to_child, readable=False)
        self.conn = mpc.Connection(from_child, writable=False)
        self.out.send_bytes(init)
        self.ready = False
        self.started = time.monotonic()
        self.sent: collections.deque[int] = collections.deque()  # ids sent, not answered yet
        self.units: collections.deque[int] = collections.deque()  # calls per unit of sent, in order
        self.since = 0.0  # when the unit it is running (units[0] calls at the head of sent) started
        self.revoked = False  # the calls of its chunk it has not started were queued again

    @property
    def running(self) -> list[int]:
        """The ids of the unit it is running (one call, or a whole batch)."""
        return list(self.sent)[:self.units[0] if self.units else 1]

    @property
    def exitcode(self):
        return self.proc.poll()

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session too (where /proc cannot be read)
        except OSError:  # already gone
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()
        self.out.close()


class RewardExecutor:
    """See the module docstring."""

    def __init__(self, build: Callable, specs: Sequence, workers: int, timeout_s: float,
                 plugins: Sequence[str] = (), chunk: int = 32, start_timeout_s: float = 120.0,
                 levels: Optional[Sequence[str]] = None, spares: bool = True, give_up_after: int = 0,
                 timeout_key: str = "rewards.timeout_s"):
        """``levels``: ``"sample"`` or ``"group"`` per spec (default all sample-level). ``spares``:
        whether stalled calls may start spare workers (off for rewards that hold a model: a
        spare loads another copy). ``give_up_after``: timeouts in a row of one reward after which
        its queued calls are not run (0: twice the largest pool; see the module docstring).
        ``timeout_key``: the setting that ``timeout_s`` came from, named in timeout messages."""
        if timeout_s <= 0 or workers < 1 or chunk < 1:
            raise ValueError(f"RewardExecutor: need timeout_s > 0, workers >= 1, chunk >= 1 "
                             f"(got {timeout_s}, {workers}, {chunk})")
        self._init = pickle.dumps((build, list(specs), list(plugins), list(sys.path), os.getpid()))
        self.start_timeout_s = float(start_timeout_s)
        self.timeout_s, self.chunk, self.base = float(timeout_s), int(chunk), int(workers)
        self.stall_s = self.timeout_s / 10
        self.levels = list(levels) if levels is not None else ["sample"] * len(specs)
        if len(self.levels) != len(specs) or set(self.levels) - {"sample", "group"}:
            raise ValueError(f"RewardExecutor: levels must be 'sample' or 'group' per spec, got {self.levels}")
        self.spares, self.timeout_key = spares, timeout_key
        self.give_up_after = int(give_up_after) or 2 * (2 * self.base if spares else self.base)
        self._late_in_row = [0] * len(specs)  # per reward: calls timed out since its last finished one
        self.batch_sizes: Optional[list[int]] = None  # per spec, reported by the first worker ready
        self._pending: dict[int, RewardCall] = {}  # id -> call, not decided
        self._queue: collections.deque[int] = collections.deque()
        self._done: dict[int, RewardOutcome] = {}
        self._next_id = 0
        self._lock = threading.Condition()  # all state; the pump notifies it when calls are decided
        self._closed, self._fatal = False, ""
        self.restarts = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers = [_Worker(self._init) for _ in range(workers)]
        try:
            self._wait_ready(time.monotonic() + start_timeout_s)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._pump, name="megaforge-reward-pump", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------- public
    def submit(self, calls: Sequence[RewardCall]) -> list[int]:
        """Queue ``calls`` (each must finish within ``timeout_s`` of its start); returns their ids. They
        are dispatched, and their results read, by the executor's thread while the caller goes on."""
        with self._lock:
            self._check()
            ids = list(range(self._next_id, self._next_id + len(calls)))
            self._next_id += len(calls)
            for i, c in zip(ids, calls):
                self._pending[i] = c
                self._queue.append(i)
        self._wake()
        return ids

    def collect(self, ids: Sequence[int]) -> list[RewardOutcome]:
        """Wait until every call of ``ids`` is decided (a started call at the latest at its deadline)."""
        with self._lock:
            while True:
                self._check()
                if not any(i in self._pending for i in ids):
                    return [self._done.pop(i) for i in ids]
                self._lock.wait(1.0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if getattr(self, "_thread", None) is not None:
            self._wake()
            self._thread.join(timeout=10)
        for w in getattr(self, "_workers", []):
            w.kill()
        self._workers = []
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    @property
    def broken(self) -> str:
        """Why the executor stopped working (a replacement worker could not start), else ``""``."""
        return self._fatal

    # ------------------------------------------------------------------------------- the pump
    def _check(self) -> None:
        if self._fatal:
            raise RuntimeError(self._fatal)
        if self._closed:
            raise RuntimeError("the reward executor is closed")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # already awake (a full pipe), or closed
            pass

    def _pump(self) -> None:
        """The executor's thread: deadlines, stalls and dispatch, then the workers' results as they
        come (waiting on their pipes and on the wake-up pipe of submit / close)."""
        while True:
            with self._lock:
                if self._closed or self._fatal:
                    return
                try:
                    now = time.monotonic()
                    self._expire(now)
                    self._unstall(now)
                    self._dispatch(now)
                except Exception as e:  # noqa: BLE001 - e.g. a replacement worker failed to start
                    self._fatal = f"reward executor: {type(e).__name__}: {e}"
                self._lock.notify_all()
                deadlines = [w.since + self.timeout_s for w in self._workers if w.sent] + \
                    [w.started + self.start_timeout_s for w in self._workers if not w.ready]
                wait_s = max(0.0, min(min(deadlines) - now, self.stall_s / 2)) if deadlines else None
                conns = {w.conn: w for w in self._workers}
            ready = mpc.wait(list(conns) + [self._wake_r], timeout=wait_s)
            with self._lock:
                if self._closed:
                    return
                try:
                    if self._wake_r in ready:
                        os.read(self._wake_r, 4096)
                    for conn in ready:
                        if conn in conns and conns[conn] in self._workers:
                            self._receive(conns[conn])
                except Exception as e:  # noqa: BLE001
                    self._fatal = f"reward executor: {type(e).__name__}: {e}"
                self._lock.notify_all()

    # ------------------------------------------------------------------------------- internals
    def _wait_ready(self, deadline: float) -> None:
        while not all(w.ready for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"reward workers did not start within the start-up limit "
                                   f"({sum(w.ready for w in self._workers)}/{len(self._workers)} ready)")
            for conn in mpc.wait([w.conn for w in self._workers if not w.ready], timeout=left):
                w = next(w for w in self._workers if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    w.kill()
                    raise RuntimeError(f"a reward worker died while building the rewards "
                                       f"(exit status {w.exitcode})") from None
                if msg[0] == "error":
                    raise ValueError(msg[1])
                self._ready(w, msg)

    def _ready(self, w: _Worker, msg: tuple) -> None:
        w.ready = True
        if self.batch_sizes is None:
            self.batch_sizes = list(msg[1])

    def _decide(self, cid: int, outcome: RewardOutcome) -> None:
        if self._pending.pop(cid, None) is not None:  # the first outcome of a call counts
            self._done[cid] = dataclasses.replace(outcome, at=time.monotonic())

    def _requeue_unstarted(self, w: _Worker) -> None:
        if not w.revoked:
            started = len(w.running)
            self._queue.extendleft(reversed([cid for cid in list(w.sent)[started:] if cid in self._pending]))
            w.revoked = True

    def _retire(self, w: _Worker, running: RewardOutcome) -> None:
        """Kill ``w``: its running call gets ``running``, the calls it had not started are queued
        again; a new worker takes its place while the pool is below ``workers``."""
        w.kill()
        if w.sent:
            for cid in w.running:
                self._decide(cid, running)
            self._requeue_unstarted(w)
        self._workers.remove(w)
        if len(self._workers) < self.base:
            self._workers.append(_Worker(self._init))
        self.restarts += 1

    def _expire(self, now: float) -> None:
        """Kill the workers whose running unit passed its deadline; give up on the queued calls of a
        reward that timed out ``give_up_after`` times in a row."""
        late = RewardOutcome(error=f"no result within {self.timeout_key}={self.timeout_s:g} s of its start",
                             timed_out=True)
        for w in self._workers:
            if not w.ready and now - w.started > self.start_timeout_s:  # queued calls wait on it: no deadline
                raise RuntimeError(f"a restarted reward worker did not build the rewards within the start-up "
                                   f"limit ({self.start_timeout_s:g} s)")
        for w in list(self._workers):
            if w.sent and now - w.since >= self.timeout_s:
                if w.sent[0] in self._pending:
                    self._late_in_row[self._pending[w.sent[0]].fn] += 1
                self._retire(w, late)
        for fn, n in enumerate(self._late_in_row):
            if n >= self.give_up_after:
                self._late_in_row[fn] = 0
                skipped = RewardOutcome(error=f"not run: the last {n} calls of this reward timed out ({self.timeout_key}="
                                              f"{self.timeout_s:g} s) without one finishing", timed_out=True)
                for cid in [cid for cid in self._queue if cid in self._pending and self._pending[cid].fn == fn]:
                    self._decide(cid, skipped)
        self._queue = collections.deque(cid for cid in self._queue if cid in self._pending)

    def _unstall(self, now: float) -> None:
        """A call running longer than ``stall_s`` may hang: the rest of its worker's chunk goes to
        other workers, and while nobody is free a spare worker starts (the pool grows to at most
        twice ``workers``; killed workers are not replaced above ``workers``)."""
        stalled = [w for w in self._workers if w.sent and now - w.since > self.stall_s]
        for w in stalled:
            self._requeue_unstarted(w)
        free = [w for w in self._workers if not w.sent]  # idle, or starting
        if self.spares and self._queue and stalled and not free and len(self._workers) < 2 * self.base:
            self._workers.append(_Worker(self._init))

    def _batched(self, fn: int) -> int:
        """Calls of reward ``fn`` that run as one batch (0: not batched)."""
        if self.levels[fn] == "group" or not self.batch_sizes:
            return 0
        return self.batch_sizes[fn]

    def _take_units(self) -> list[tuple[str, int, list[int]]]:
        """The next chunk, as units ``(mode, fn, ids)``, removed from the queue: up to one batch of
        the first queued call's reward when it is batched, else up to ``chunk`` single calls of
        unbatched rewards (in queue order, shared out evenly over the workers)."""
        live = [cid for cid in self._queue if cid in self._pending]
        if not live:
            self._queue = collections.deque()
            return []
        first = self._pending[live[0]].fn
        cap = self._batched(first)
        if cap:
            same = [cid for cid in live if self._pending[cid].fn == first]
            take = same[:max(1, min(cap, math.ceil(len(same) / len(self._workers))))]
            units = [("batch", first, take)]
        else:
            single = [cid for cid in live if not self._batched(self._pending[cid].fn)]
            take = single[:max(1, min(self.chunk, math.ceil(len(single) / len(self._workers))))]
            units = [("group" if self.levels[f] == "group" else "one", f, [cid])
                     for cid, f in ((cid, self._pending[cid].fn) for cid in take)]
        taken = set(take)
        self._queue = collections.deque(cid for cid in live if cid not in taken)
        return units

    def _dispatch(self, now: float) -> None:
        idle = [w for w in self._workers if w.ready and not w.sent]
        while idle and self._queue:
            units = self._take_units()
            if not units:
                break
            w = idle.pop()
            w.sent = collections.deque(cid for _, _, ids in units for cid in ids)
            w.units = collections.deque(len(ids) for _, _, ids in units)
            w.since, w.revoked = now, False
            try:
                w.out.send([(mode, fn, [(cid, c.prompt, c.response, c.target)
                                        for cid, c in ((cid, self._pending[cid]) for cid in ids)])
                            for mode, fn, ids in units])
            except OSError:  # BrokenPipeError: it died
                self._died(w)

    def _died(self, w: _Worker) -> None:
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._retire(w, RewardOutcome(error=f"the reward worker died in this call (exit status {w.exitcode})"))

    def _receive(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    self._ready(w, msg)
                elif msg[0] == "error":  # a new worker failed to build what the first ones built
                    raise RuntimeError(f"a restarted reward worker could not build the rewards: {msg[1]}")
                else:
                    cid, value, error, timed_out = msg
                    w.sent.popleft()
                    if cid in self._pending and not error:
                        self._late_in_row[self._pending[cid].fn] = 0
                    w.units[0] -= 1
                    if not w.units[0]:
                        w.units.popleft()
                        w.since = time.monotonic()
                    self._decide(cid, RewardOutcome(value=value, error=error, timed_out=timed_out))
        except (EOFError, OSError):
            if not w.ready:  # queued calls would wait on replacements dying the same way
                w.kill()
                raise RuntimeError(f"a restarted reward worker died while building the rewards (exit status "
                                   f"{w.exitcode})") from None
            self._died(w)
