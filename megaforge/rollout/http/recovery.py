"""Engine fault tolerance of :class:`megaforge.rollout.http.engine.HTTPEngine` (``rollout.engine``
``embedded_server`` and ``sglang``).

When an engine fails:

* **detected** by the health check the loop runs at the start of every step
  (:meth:`Recovery.ensure_healthy`: the process is alive and the kind's ``health_probe`` answers within
  ``rollout.health_timeout_s``), and by any failed request: the process exited, the connection was
  refused or dropped, or no answer came within ``rollout.request_timeout_s`` (a hung engine). An HTTP
  error answer is a fault only when the process is gone, or it is a 5xx and the probe fails too;
  other errors (HTTP 400: a bad request) are raised as they are. The probe is one the server answers
  only when its engine loop does: ``/health_generate`` for megaforge's embedded server (it answers at
  the engine's next decoding step); ``/server_info`` for SGLang, whose answer is a round trip to the
  scheduler (``get_internal_state``), because SGLang 0.5.16's ``/health_generate`` sleeps 1 s before it
  first looks for the scheduler's answer (``http_server.health_generate``): a second of every step.
* **restarted** (:meth:`megaforge.rollout.http.processes.ServerProcess.restart`): SIGTERM then SIGKILL (a
  stopped process too), the same command, on the same port when it can be bound again (required
  with a router in front), the reason appended to ``<run dir>/logs/engine_K.log``;
* **re-synced** to the version the engines serve, from the weight snapshot
  (:mod:`megaforge.rollout.http.snapshot`: the bytes the last update sent, written by the update itself):
  with ``sync.transport nccl`` over a weight-update group of the restarted engine alone (the same
  broadcast as an update), else through ``/update_weights_from_disk``; the served version is checked
  afterwards;
* its **memory state** restored (the tags the loop released are released again);
* its **unfinished requests re-issued** (see ``HTTPEngine.generate``): a request is done once an
  answer with its rid arrived; only requests without one are sent again, each answer is kept once
  (dedupe by rid), so every prompt gets its samples exactly once. A re-issued chunk is the same batch
  with the same seeds and weights, so seeded requests regenerate the same tokens.

A failure during a tensor weight update marks that engine failed; the remaining buckets still reach
the other engines and the snapshot, and the failed engine is restarted with the new version after.
(With ``sync.transport: nccl`` a failure during the broadcast of an update is not recovered: the error
is raised.)

``rollout.max_restarts`` bounds the restarts of each engine per step (the budget is reset by
``ensure_healthy``); one more failure raises :class:`EngineFailure` naming the engine, its URL, the
last failure and the engine's log file (with its last lines). ``health_metrics()`` reports
``health/engine_restarts``: restarts since the previous report.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Optional

import aiohttp

from megaforge.rollout.http.client import EngineHTTPError, EngineUnreachable, SGLangClient
from megaforge.rollout.http.processes import tail

log = logging.getLogger("megaforge.rollout.http.recovery")
ROUTER = -1  # target index of requests sent through the router

FAULTS = (EngineUnreachable, aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class EngineFailure(RuntimeError):
    """An engine failed and cannot be brought back (restart limit reached, or not ours to restart)."""

    def __init__(self, message: str, engine: str = "", log_path: str = ""):
        super().__init__(message)
        self.engine, self.log_path = engine, log_path


class Recovery:
    """Mixin of HTTPEngine (which provides ``clients``, ``processes``, ``router``, ``snapshot``,
    ``_released``, ``_call``, ``restart_server``, ``_resync``)."""

    def _init_recovery(self, max_restarts: int, health_timeout_s: float, startup_timeout_s: float,
                       health_probe: str = "/health_generate") -> None:
        if max_restarts < 0:
            raise ValueError(f"rollout.max_restarts must be >= 0, got {max_restarts}")
        self.max_restarts, self.health_timeout_s, self.health_probe = max_restarts, health_timeout_s, health_probe
        self.startup_timeout_s = startup_timeout_s
        n = len(self.clients)
        self._epochs = [0] * n  # bumped by every restart: a failure seen on an older epoch is already handled
        self._step_restarts = [0] * n
        self._unreported = 0
        self._recover_lock = threading.RLock()

    # ---------------------------------------------------------------------------------- helpers
    def epoch(self, k: int) -> int:
        """Restarts of engine ``k`` so far (a failure seen at an older epoch is already handled)."""
        return self._epochs[k]

    def _proc(self, k: int):
        return next((p for p in self.processes if p.name == f"engine_{k}"), None)

    def _name(self, k: int) -> str:
        return f"engine_{k} ({self.clients[k].url})"

    def _exited(self, k: int) -> Optional[str]:
        p = self._proc(k)
        if p is not None and p.proc is not None and p.proc.poll() is not None:
            return f"the process exited with code {p.proc.returncode}"
        return None

    async def _probe(self, k: int, client: SGLangClient) -> Optional[str]:
        """None when engine ``k`` is healthy, else why not."""
        dead = self._exited(k)
        if dead:
            return dead
        path = "/health" if self._released & {"weights", "kv_cache"} else self.health_probe
        try:
            await client.request("GET", path, timeout_s=self.health_timeout_s, retries=0)
            return None
        except EngineHTTPError as e:
            return f"{path} answered HTTP {e.status}: {e.body[:200].strip()}"
        except FAULTS as e:
            return f"{path}: {type(e).__name__}: {e}"

    def is_fault(self, k: int, exc: BaseException) -> bool:
        """Whether ``exc`` from engine ``k`` (or ROUTER) means a dead or hung engine (see the module doc)."""
        if isinstance(exc, FAULTS):
            return True
        if isinstance(exc, EngineHTTPError) and k != ROUTER:
            if self._exited(k):
                return True
            return exc.status >= 500 and self._call(self._probe(k, self.clients[k])) is not None
        return False

    # ---------------------------------------------------------------------------------- restarts
    def ensure_healthy(self) -> None:
        """Health-check every engine; restart (and re-sync) the unhealthy ones. Called by the loop at
        the start of each step; starts the step's restart budget."""
        self._step_restarts = [0] * len(self.clients)
        epochs = list(self._epochs)

        async def run():
            return await asyncio.gather(*(self._probe(k, c) for k, c in enumerate(self.clients)))

        for k, why in enumerate(self._call(run())):
            if why is not None:
                self._recover(k, f"health check: {why}", epochs[k])

    def health_metrics(self) -> dict:
        n, self._unreported = self._unreported, 0
        return {"health/engine_restarts": float(n)}

    def _recover(self, k: int, cause, epoch: Optional[int] = None) -> None:
        """Bring engine ``k`` back after ``cause`` (an exception or a reason), or raise EngineFailure.
        ``epoch``: the engine epoch the failed call used; if it has been restarted since, nothing to do."""
        with self._recover_lock:
            if epoch is not None and epoch != self._epochs[k]:
                return
            proc = self._proc(k)
            if proc is None:
                raise EngineFailure(f"{self._name(k)} failed ({_why(cause)}); it was not launched by this process (an "
                                    f"engine given by URL, or on another node), so it cannot be restarted from here",
                                    f"engine_{k}")
            while True:
                if self._step_restarts[k] >= self.max_restarts:
                    raise EngineFailure(
                        f"{self._name(k)} failed: {_why(cause)}. It was restarted {self._step_restarts[k]} time(s) in "
                        f"this step; rollout.max_restarts={self.max_restarts} allows no more. Its log: {proc.log_path}; "
                        f"last lines:\n{tail(proc.log_path, 20)}", f"engine_{k}", proc.log_path)
                self._step_restarts[k] += 1
                self._unreported += 1
                log.warning("%s failed (%s): restarting it (%d/%d this step); log: %s", self._name(k), _why(cause),
                            self._step_restarts[k], self.max_restarts, proc.log_path)
                try:
                    self._restart_and_resync(k, _why(cause))
                    return
                except Exception as e:  # noqa: BLE001  (a failed restart counts; the limit ends the loop)
                    cause = e

    def _restart_and_resync(self, k: int, reason: str) -> None:
        self._epochs[k] += 1
        self.restart_server(k, self.startup_timeout_s, reason=reason, restore_memory=False)
        c = self.clients[k]
        want = 0
        if self.snapshot is not None:
            self.snapshot.wait()  # the writes of the last update
        if self.snapshot is not None and self.snapshot.path is not None:
            want = self.snapshot.version
            self._resync(k, want)
        if self._reload_adapter(k):  # sync.lora_adapters: the base came back; the current adapter again
            want = self._adapter[2]
        got = self._call(c.get_weight_version())
        if got != want:
            raise EngineFailure(f"{self._name(k)} serves weight version {got} after its restart, expected {want}",
                                f"engine_{k}")
        if self._released:  # keep one memory state across engines
            self._call(c.release_memory_occupation(sorted(self._released)))

    def _recover_any(self, cause, epochs: list[int]) -> None:
        """Requests through the router failed (engines at ``epochs`` then): restart the unhealthy engines."""
        if epochs != self._epochs:
            return  # an engine was restarted since: re-issue

        async def run():
            return await asyncio.gather(*(self._probe(k, c) for k, c in enumerate(self.clients)))

        bad = [(k, why) for k, why in enumerate(self._call(run())) if why is not None]
        if not bad:
            raise EngineFailure(f"a request through the router ({self.router.url}) failed ({_why(cause)}) and every "
                                f"engine is healthy: the router failed", "router")
        for k, why in bad:
            self._recover(k, f"{_why(cause)}; {why}", epochs[k])

    def guarded_all(self, fn) -> list:
        """``fn(client)`` on every engine concurrently; an engine that fails with a fault is recovered and
        ``fn`` run on it again (bounded by the restart budget)."""
        todo = list(range(len(self.clients)))
        out: list = [None] * len(self.clients)
        while todo:
            epochs = [self._epochs[k] for k in todo]

            async def run(ks=tuple(todo)):
                return await asyncio.gather(*(fn(self.clients[k]) for k in ks), return_exceptions=True)

            failed = []
            for k, ep, r in zip(todo, epochs, self._call(run())):
                if isinstance(r, BaseException):
                    if not isinstance(r, Exception) or not self.is_fault(k, r):
                        raise r
                    failed.append((k, ep, r))
                else:
                    out[k] = r
            for k, ep, r in failed:
                self._recover(k, r, ep)
            todo = [k for k, _, _ in failed]
        return out


def _why(cause) -> str:
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return str(cause)
