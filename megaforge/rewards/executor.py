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
* Dispatch: queued calls go to idle workers in chunks of up to ``chunk`` calls (one message for
  many cheap calls: the math reward takes ~0.1 ms); each result comes back on its own, in order, so
  the call a worker is running is always known.
* Deadline: a call must finish within ``timeout_s`` of its submission (time in the queue
  included), so calls submitted together (a step's reward phase) are all decided within about
  ``timeout_s``, however many hang. At the deadline an unfinished call times out; the worker
  still running it is killed with its process group and replaced, and the calls of its chunk it
  had not started go back to the front of the queue (timing out too once their own deadline has
  passed).
* Stalls: a call running longer than ``timeout_s / 10`` may hang, so the calls of its chunk it has
  not started go to other workers, and while no worker is free a spare one starts (at most twice
  ``workers`` in all): a few hanging calls do not take the rest of the step with them. The first
  outcome of a call counts.
* A worker that dies in a call (a crash, the OOM killer) fails that call naming its exit status
  and is replaced; so is one killed at a deadline (``restarts`` counts both), up to ``workers``.
* :meth:`close` kills the workers at once: nothing waits on a stuck call at the end of a run.

A reward value must be a finite number (``float(v)``); anything else, or an exception, is an
error outcome carrying ``"ExcType: message"``.
"""
from __future__ import annotations

import collections
import ctypes
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

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RewardCall:
    fn: int  # index of the reward in the executor's specs
    prompt: str
    response: str
    target: Any


@dataclass
class RewardOutcome:
    value: Optional[float] = None
    error: str = ""  # "ExcType: message" when the call raised or returned a non-finite / non-number
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.value is not None


def worker_entry() -> None:
    """A reward worker (``python -c ...`` started by :class:`_Worker`): build the rewards, then
    answer chunks of calls one result at a time. Its pipes' descriptors are ``argv[1:3]``."""
    inbox = mpc.Connection(int(sys.argv[1]), writable=False)
    outbox = mpc.Connection(int(sys.argv[2]), readable=False)
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the trainer's close() still kills it
        pass
    build, specs, plugins, path, parent = pickle.loads(inbox.recv_bytes())
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(0)
    sys.path[:] = path
    try:
        import importlib

        for name in plugins:
            importlib.import_module(name)
        fns = [build(s) for s in specs]
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        outbox.send(("error", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
        return
    outbox.send(("ready",))
    while True:
        try:
            chunk = inbox.recv()
        except (EOFError, OSError):
            return
        for cid, fn, prompt, response, target in chunk:
            try:
                v = float(fns[fn](prompt, response, target))
                if not math.isfinite(v):
                    raise ValueError(f"returned {v}")
                out = (cid, v, "")
            except Exception as e:  # noqa: BLE001 - a user reward may raise anything
                out = (cid, None, f"{type(e).__name__}: {e}")
            outbox.send(out)


class _Worker:
    """One worker process, started from an argument list (not multiprocessing's spawn, which would
    re-import the trainer's ``__main__``), in a session of its own, with two pipes."""

    def __init__(self, init: bytes):
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = ("import sys; sys.path.insert(0, sys.argv[3]); "
                "from megaforge.rewards.executor import worker_entry; worker_entry()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(from_parent), str(to_parent), root],
                                     pass_fds=(from_parent, to_parent), stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(from_parent)
        os.close(to_parent)
        self.out = mpc.Connection(to_child, readable=False)
        self.conn = mpc.Connection(from_child, writable=False)
        self.out.send_bytes(init)
        self.ready = False
        self.sent: collections.deque[tuple[int, float]] = collections.deque()  # (id, deadline) not answered yet
        self.since = 0.0  # when the call it is running (sent[0]) started
        self.revoked = False  # the calls of its chunk it has not started were queued again

    @property
    def exitcode(self):
        return self.proc.poll()

    def kill(self) -> None:
        for kill in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), self.proc.kill):
            try:
                kill()
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
                 plugins: Sequence[str] = (), chunk: int = 32, start_timeout_s: float = 120.0):
        if timeout_s <= 0 or workers < 1 or chunk < 1:
            raise ValueError(f"RewardExecutor: need timeout_s > 0, workers >= 1, chunk >= 1 "
                             f"(got {timeout_s}, {workers}, {chunk})")
        self._init = pickle.dumps((build, list(specs), list(plugins), list(sys.path), os.getpid()))
        self.timeout_s, self.chunk, self.base = float(timeout_s), int(chunk), int(workers)
        self.stall_s = self.timeout_s / 10
        self._pending: dict[int, tuple[RewardCall, float]] = {}  # id -> (call, deadline), not decided
        self._queue: collections.deque[int] = collections.deque()
        self._done: dict[int, RewardOutcome] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        self.restarts = 0
        self._workers = [_Worker(self._init) for _ in range(workers)]
        try:
            self._wait_ready(time.monotonic() + start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------------------------- public
    def submit(self, calls: Sequence[RewardCall]) -> list[int]:
        """Queue ``calls`` (each must finish within ``timeout_s`` from now); returns their ids."""
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            ids = list(range(self._next_id, self._next_id + len(calls)))
            self._next_id += len(calls)
            for i, c in zip(ids, calls):
                self._pending[i] = (c, deadline)
                self._queue.append(i)
            self._dispatch(time.monotonic())
            return ids

    def collect(self, ids: Sequence[int]) -> list[RewardOutcome]:
        """Wait until every call of ``ids`` is decided (at the latest at its deadline)."""
        with self._lock:
            while True:
                now = time.monotonic()
                self._expire(now)
                self._unstall(now)
                self._dispatch(now)
                waiting = [self._pending[i][1] for i in ids if i in self._pending]
                if not waiting:
                    return [self._done.pop(i) for i in ids]
                wait_s = max(0.0, min(min(waiting) - now, self.stall_s / 2))
                for conn in mpc.wait([w.conn for w in self._workers], timeout=wait_s):
                    w = next((w for w in self._workers if w.conn is conn), None)
                    if w is not None:
                        self._receive(w)

    def close(self) -> None:
        for w in getattr(self, "_workers", []):
            w.kill()
        self._workers = []

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
                w.ready = True

    def _decide(self, cid: int, outcome: RewardOutcome) -> None:
        if self._pending.pop(cid, None) is not None:  # the first outcome of a call counts
            self._done[cid] = outcome

    def _requeue_unstarted(self, w: _Worker) -> None:
        if not w.revoked:
            self._queue.extendleft(reversed([cid for cid, _ in list(w.sent)[1:] if cid in self._pending]))
            w.revoked = True

    def _retire(self, w: _Worker, running: RewardOutcome) -> None:
        """Kill ``w``: its running call gets ``running``, the calls it had not started are queued
        again; a new worker takes its place while the pool is below ``workers``."""
        w.kill()
        if w.sent:
            self._decide(w.sent[0][0], running)
            self._requeue_unstarted(w)
        self._workers.remove(w)
        if len(self._workers) < self.base:
            self._workers.append(_Worker(self._init))
        self.restarts += 1

    def _expire(self, now: float) -> None:
        late = RewardOutcome(error=f"no result within rewards.timeout_s={self.timeout_s:g} s", timed_out=True)
        for w in list(self._workers):
            if w.sent and w.sent[0][1] <= now:
                self._retire(w, late)
        kept = collections.deque()
        for cid in self._queue:
            if cid not in self._pending:
                continue
            if self._pending[cid][1] <= now:
                self._decide(cid, late)
            else:
                kept.append(cid)
        self._queue = kept

    def _unstall(self, now: float) -> None:
        """A call running longer than ``stall_s`` may hang: the rest of its worker's chunk goes to
        other workers, and while nobody is free a spare worker starts (the pool grows to at most
        twice ``workers``; killed workers are not replaced above ``workers``)."""
        stalled = [w for w in self._workers if w.sent and now - w.since > self.stall_s]
        for w in stalled:
            self._requeue_unstarted(w)
        free = [w for w in self._workers if not w.sent]  # idle, or starting
        if self._queue and stalled and not free and len(self._workers) < 2 * self.base:
            self._workers.append(_Worker(self._init))

    def _dispatch(self, now: float) -> None:
        idle = [w for w in self._workers if w.ready and not w.sent]
        while idle and self._queue:
            w = idle.pop()
            n = max(1, min(self.chunk, math.ceil(len(self._queue) / len(self._workers))))
            ids = []
            while self._queue and len(ids) < n:
                cid = self._queue.popleft()
                if cid in self._pending:
                    ids.append(cid)
            if not ids:
                break
            w.sent = collections.deque((cid, self._pending[cid][1]) for cid in ids)
            w.since, w.revoked = now, False
            try:
                w.out.send([(cid, c.fn, c.prompt, c.response, c.target)
                             for cid, c in ((cid, self._pending[cid][0]) for cid in ids)])
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
                    w.ready = True
                elif msg[0] == "error":  # a new worker failed to build what the first ones built
                    raise RuntimeError(f"a restarted reward worker could not build the rewards: {msg[1]}")
                else:
                    cid, value, error = msg
                    w.sent.popleft()
                    w.since = time.monotonic()
                    self._decide(cid, RewardOutcome(value=value, error=error))
        except (EOFError, OSError):
            self._died(w)
