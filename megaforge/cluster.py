"""Where this process sits in a torchrun job, the process group with sane timeouts, and the rank
watchdog that tears a failed job down in bounded time.

torchrun (one agent per node, standard rendezvous variables) starts ``LOCAL_WORLD_SIZE`` processes
per node and numbers them node-major: global rank ``r`` is local rank ``r % LOCAL_WORLD_SIZE`` of
node ``GROUP_RANK = r // LOCAL_WORLD_SIZE`` (homogeneous nodes, which megaforge requires).

Failure of any rank ends every rank within a bounded time:

* a rank that raises reports it (:meth:`Job.report_failure`: key ``megaforge/<restart>/failed`` in the
  rendezvous store, the torchrun agent's TCPStore at ``MASTER_ADDR:MASTER_PORT``) before exiting;
* every rank of a run (the :class:`Job` its launcher or :class:`megaforge.loop.Run` holds) runs a
  :class:`Watchdog` thread with its own store connection. Each period
  (``launch.heartbeat_s``) it bumps its heartbeat counter ``megaforge/<restart>/hb/<rank>`` and reads
  the failure key and the other ranks' counters. It ends this process (engine servers stopped first,
  then ``os._exit(1)``) when

  - another rank reported a failure and this process has not exited ``launch.abort_grace_s`` later;
  - a rank's counter has not changed for ``launch.peer_timeout_s`` (a rank killed by SIGKILL, a
    segfault, the OOM killer, a dead node) unless that rank said it finished (``done/<rank>``);
  - the store has been unreachable for ``launch.peer_timeout_s`` (node 0's agent is gone).

  Counters, not wall-clock stamps, so node clocks need not agree: staleness is measured on the
  observer's monotonic clock.

Bound: a rank that raises ends the others within ``abort_grace_s + heartbeat_s``, plus the time to
stop their engine servers (SIGTERM, SIGKILL after 5 s); a rank that vanishes, within
``peer_timeout_s + heartbeat_s`` plus the same. Independently,
torchrun's agent ends the other ranks of the failed rank's node (SIGTERM, SIGKILL 30 s later), and
collectives time out after ``launch.dist_timeout_s``. The keys carry ``TORCHELASTIC_RESTART_COUNT``
so a torchrun ``--max_restarts`` round never sees the previous round's failure.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from megaforge import collective
from megaforge.supervise import PROCESS_CHILDREN


@dataclass(frozen=True)
class ProcessPlace:
    """This process in the job: ranks and nodes as torchrun numbers them."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def node(self) -> int:
        return self.rank // self.local_world

    @property
    def nodes(self) -> int:
        return max(1, self.world // self.local_world)

    @property
    def node_leader(self) -> bool:
        """Local rank 0: the process that starts this node's engine servers."""
        return self.local_rank == 0


def place_from_env(env: Optional[dict] = None) -> ProcessPlace:
    """The torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); one
    process when absent. Heterogeneous nodes (``WORLD_SIZE`` not a multiple of ``LOCAL_WORLD_SIZE``)
    are refused: placement assumes every node runs the same number of ranks."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return ProcessPlace()
    world = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if world % local_world:
        raise RuntimeError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: run the same "
                           f"torchrun --nproc_per_node on every node")
    return ProcessPlace(int(env.get("RANK", 0)), world, int(env.get("LOCAL_RANK", 0)), local_world)


# ------------------------------------------------------------------------------------ watchdog
_PREFIX = "megaforge/{restart}/"


def _key(name: str) -> str:
    return _PREFIX.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + name


def _stop_children() -> None:
    """Stop every child process (engine servers) this process started (SIGTERM, SIGKILL after 5 s)."""
    try:
        PROCESS_CHILDREN.stop_all()
    except Exception as e:  # noqa: BLE001  (best effort on the way out; PDEATHSIG still kills them)
        print(f"[megaforge] stopping engine servers failed: {e}", file=sys.stderr, flush=True)


class Watchdog:
    """One daemon thread per rank; see the module docstring. ``exit_fn`` ends the process (tests
    replace it)."""

    def __init__(self, store, rank: int, world: int, heartbeat_s: float, peer_timeout_s: float,
                 abort_grace_s: float, exit_fn=None):
        self.store, self.rank, self.world = store, rank, world
        self.heartbeat_s, self.peer_timeout_s, self.abort_grace_s = heartbeat_s, peer_timeout_s, abort_grace_s
        self.exit_fn = exit_fn or _hard_exit
        self._stop = threading.Event()
        self._beat = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last counter, monotonic time it changed)
        self._store_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="megaforge-watchdog", daemon=True)
        self.reason: Optional[str] = None

    def start(self) -> "Watchdog":
        self.store.set(_key(f"hb/{self.rank}"), b"0")
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop watching; ``done``: tell the others this rank finished (its heartbeat stops on purpose)."""
        self._stop.set()
        if done:
            try:
                self.store.set(_key(f"done/{self.rank}"), b"1")
            except Exception:  # noqa: BLE001
                pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.heartbeat_s + 1)

    def report(self, what: str) -> None:
        self.store.set(_key("failed"), f"rank {self.rank}: {what}".encode())

    # ------------------------------------------------------------------------------ the thread
    def check_once(self) -> Optional[str]:
        """One period: heartbeat, then the reason to end this process (None: all is well)."""
        now = time.monotonic()
        try:
            self._beat += 1
            self.store.set(_key(f"hb/{self.rank}"), str(self._beat).encode())
            if self.store.check([_key("failed")]):
                return "failed:" + self.store.get(_key("failed")).decode(errors="replace")
            others = [r for r in range(self.world) if r != self.rank]
            hb_keys = [_key(f"hb/{r}") for r in others]
            done_keys = [_key(f"done/{r}") for r in others]
            for r, hk, dk in zip(others, hb_keys, done_keys):
                if not self.store.check([hk]) or self.store.check([dk]):
                    continue  # not started yet (torchrun's rendezvous bounds that), or finished
                val = self.store.get(hk)
                last = self._seen.get(r)
                if last is None or last[0] != val:
                    self._seen[r] = (val, now)
                elif now - last[1] > self.peer_timeout_s:
                    return (f"rank {r} sent no heartbeat for {now - last[1]:.0f} s (launch.peer_timeout_s="
                            f"{self.peer_timeout_s:g}): it died or hangs")
            self._store_ok = now
        except Exception as e:  # noqa: BLE001  (store unreachable: node 0's agent gone, network)
            if now - self._store_ok > self.peer_timeout_s:
                return f"the rendezvous store has been unreachable for {now - self._store_ok:.0f} s ({type(e).__name__}: {e})"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            why = self.check_once()
            if why is None:
                continue
            if why.startswith("failed:"):
                why = why[len("failed:"):]
                if self._stop.wait(self.abort_grace_s):
                    return  # this process ended on its own
                why = f"{why}; this rank did not finish within launch.abort_grace_s={self.abort_grace_s:g} s"
            self.reason = why
            self.exit_fn(self.rank, why)
            return


def _hard_exit(rank: int, why: str) -> None:
    print(f"[megaforge] rank {rank}: ending this process: {why}", file=sys.stderr, flush=True)
    _stop_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _store_client(timeout_s: float):
    """A connection of our own to the rendezvous store (the watchdog thread never shares the process
    group's client with the main thread)."""
    import torch.distributed as tdist

    return tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


# --------------------------------------------------------------------------------- entry points
class Job:
    """This process's part in a torchrun job, held by whoever runs it (:func:`megaforge.launch.main` for a
    launcher's run; a :class:`megaforge.loop.Run` started from Python makes its own): the rank watchdog
    :func:`init_distributed` started for it, and what must stop when the run ends (:meth:`at_end`)."""

    def __init__(self):
        self.watchdog: Optional[Watchdog] = None
        self._at_end: list[Callable[[bool], None]] = []

    def at_end(self, fn: Callable[[bool], None]) -> None:
        """``fn(together)`` at :meth:`end` (last registered first), e.g. stopping this node's engine servers."""
        self._at_end.append(fn)

    def report_failure(self, exc: BaseException) -> None:
        """Tell every other rank that this one is failing (before it exits)."""
        if self.watchdog is None:
            return
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
        try:
            self.watchdog.report(msg[0][:500] if msg else type(exc).__name__)
        except Exception as e:  # noqa: BLE001  (the store may be what failed)
            print(f"[megaforge] could not report the failure to the other ranks: {e}", file=sys.stderr, flush=True)
        self.watchdog.stop(done=False)

    def end(self, together: bool) -> None:
        """The run is over. ``together``: it ended the same way on every rank (done, or a stop every rank
        shares). The :meth:`at_end` calls first, then, when ``together``, the watchdog stops and tells the
        others this rank finished (after those calls: a barrier among them is still guarded)."""
        fns, self._at_end = self._at_end[::-1], []
        for fn in fns:
            fn(together)
        if together and self.watchdog is not None:
            self.watchdog.stop(done=True)
            self.watchdog = None


def init_distributed(la, device_type: str, job: Optional[Job] = None) -> ProcessPlace:
    """The default process group from torchrun's variables with ``launch.dist_timeout_s``, and, for
    ``job`` (more than one process), its watchdog (one per job: ``launch.heartbeat_s``,
    ``launch.peer_timeout_s``, ``launch.abort_grace_s``). ``la``: the ``launch`` section. Returns this
    process's place."""
    place = place_from_env()
    collective.init_from_env(device_type, timeout_s=la.dist_timeout_s)
    if (job is not None and job.watchdog is None and collective.initialized() and collective.world() > 1
            and "MASTER_ADDR" in os.environ):
        job.watchdog = Watchdog(_store_client(min(30.0, la.peer_timeout_s)), collective.rank(), collective.world(),
                                la.heartbeat_s, la.peer_timeout_s, la.abort_grace_s).start()
    return place
