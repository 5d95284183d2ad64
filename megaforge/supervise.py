"""Process supervision: child processes that never outlive megaforge, and their environment.

Below everything that starts a process (engine servers in :mod:`megaforge.rollout.http.processes`,
torchrun under :mod:`megaforge.slurm`, the rank watchdog of :mod:`megaforge.cluster`, reward workers);
imports nothing of megaforge's, and no torch.

* :func:`die_with_parent`: ``PR_SET_PDEATHSIG`` (Linux; nothing elsewhere): the kernel sends a signal
  to this process when its parent *thread* dies, even by SIGKILL. :func:`preexec` wraps it for
  ``subprocess.Popen(preexec_fn=...)``, and exits at once when the parent died before the call.
* :class:`Children`: what one process started and must stop. A child started from a thread other
  than the main one is forked by the registry's spawner thread, which lives as long as the process
  (the death signal follows the thread that forked). Every registered child is stopped (SIGTERM to
  its process group, SIGKILL after a grace period: :func:`stop_group`) by its owner, an ``atexit``
  hook, and, where the program leaves SIGTERM/SIGHUP at their default (which would end it without
  ``atexit``), handlers that stop the children and then die by the signal as before. A program that
  handles SIGTERM itself (the RL loop's graceful stop) keeps its handler: its exit path stops them.
* :func:`child_env`, :func:`env_from_script`: a child's environment without torchrun's rendezvous
  variables; the variables a shell file sets.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Final, Optional, Protocol

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file is megaforge/supervise.py


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved at import, before any fork: a preexec_fn child only calls it (no dlopen between fork and exec).
# Constant after import, not state.
_PRCTL: Final = _libc_prctl()


def die_with_parent(sig: int) -> bool:
    """The kernel sends ``sig`` to this process when its parent (thread) dies (``PR_SET_PDEATHSIG``).
    True when set; False where it cannot be (not Linux, or prctl failed: ``ctypes.get_errno()``)."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Orphans of this process's descendants are reparented to it, not to init
    (``PR_SET_CHILD_SUBREAPER``), so its process tree keeps them. True when set."""
    return _PRCTL is not None and _PRCTL(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def preexec(parent_pid: int, sig: int = signal.SIGKILL,
            before: Optional[Callable[[], None]] = None) -> Callable[[], None]:
    """A ``preexec_fn``: ``before()`` (e.g. signal dispositions to inherit), then :func:`die_with_parent`
    with ``sig``; exits (status 1) when the parent ``parent_pid`` died before the death signal was set."""
    def run():
        if before is not None:
            before()
        die_with_parent(sig)
        if os.getppid() != parent_pid:
            os._exit(1)
    return run


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to ``proc``'s process group (``proc`` started with ``start_new_session``), SIGKILL to the
    group after ``grace_s`` (which also ends anything it left in its group); reaps ``proc``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


class Stoppable(Protocol):
    def stop(self, grace_s: float = ...) -> None: ...


class Children:
    """The children one process started and must stop (see the module docstring): ``add`` when started,
    ``discard`` when stopped by their owner; :meth:`stop_all` stops the rest."""

    def __init__(self):
        self._live: list[Stoppable] = []
        self._lock = threading.RLock()  # re-entered when a signal handler (stop_all) interrupts add/discard
        self._spawner: Optional[ThreadPoolExecutor] = None
        self._hooked = False

    def spawn(self, fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        """``fn()`` (a Popen with :func:`preexec`) on the main thread, or on the spawner thread, which
        lives as long as the process: PR_SET_PDEATHSIG fires when the thread that forked the child ends."""
        if threading.current_thread() is threading.main_thread():
            return fn()
        with self._lock:
            if self._spawner is None:
                self._spawner = ThreadPoolExecutor(1, thread_name_prefix="megaforge-spawner")
            spawner = self._spawner
        return spawner.submit(fn).result()

    def add(self, child: Stoppable) -> None:
        self._install_hooks()
        with self._lock:
            self._live.append(child)

    def discard(self, child: Stoppable) -> None:
        with self._lock:
            if child in self._live:
                self._live.remove(child)

    def live(self) -> list[Stoppable]:
        with self._lock:
            return list(self._live)

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every child registered and not stopped yet (each ``stop`` discards itself)."""
        for c in self.live():
            c.stop(grace_s=grace_s)
            self.discard(c)

    def _install_hooks(self) -> None:
        with self._lock:
            if self._hooked:
                return
            self._hooked = True
        atexit.register(self.stop_all)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit + PDEATHSIG still apply
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) != signal.SIG_DFL:
                continue  # the program handles it (e.g. the loop's graceful stop): its exit path stops the children

            def handler(signum, frame):
                self.stop_all()
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

            signal.signal(sig, handler)


#: This process's children. One per process, not per run: the atexit hook, the SIGTERM/SIGHUP handlers and
#: the watchdog's hard exit (megaforge.cluster) end the *process*, and must stop every child it started,
#: whichever engine, test or tool started it. The binding never changes; the state is the object's.
PROCESS_CHILDREN: Final = Children()


#: variables torchrun (torch.distributed.run / the elastic agent) sets for its workers: a server started
#: from a rank must not see them (SGLang joins the starting rank's rendezvous and hangs at "Init torch
#: distributed begin" otherwise)
RENDEZVOUS_VARS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"})
RENDEZVOUS_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")


def is_rendezvous_var(name: str) -> bool:
    return name in RENDEZVOUS_VARS or name.startswith(RENDEZVOUS_PREFIXES)


def child_env(gpus: Optional[list[int]] = None, extra: Optional[dict] = None, repo_on_path: bool = True) -> dict:
    """The environment of a child process (e.g. an engine server): this one's, without torchrun's
    rendezvous variables (:data:`RENDEZVOUS_VARS`), with ``CUDA_VISIBLE_DEVICES`` set to ``gpus`` when
    given, megaforge's source tree first on ``PYTHONPATH`` when ``repo_on_path`` (the embedded server),
    then ``extra`` (e.g. ``rollout.engine_env``: its ``PYTHONPATH`` replaces this process's)."""
    env = {k: v for k, v in os.environ.items() if not is_rendezvous_var(k)}
    if repo_on_path:
        env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env = pin_gpus(env, gpus)
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    return env


def pin_gpus(env: dict, gpus: Optional[list[int]]) -> dict:
    """A copy of the environment ``env`` with ``CUDA_VISIBLE_DEVICES`` set to ``gpus`` (``env`` itself when
    ``gpus`` is None: a server off CUDA)."""
    return env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def env_from_script(path: str) -> dict:
    """The environment variables a shell file sets or changes when sourced (e.g. an SGLang install's
    ``env.sh``), as a dict for ``rollout.engine_env``; this process's environment is not touched."""
    out = subprocess.run(["bash", "-c", 'set -a; . "$1" >/dev/null; env -0', "_", path], capture_output=True)
    if out.returncode != 0:
        raise RuntimeError(f"sourcing {path} failed (exit {out.returncode}): {out.stderr.decode()[-400:]}")
    env = dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if "=" in kv)
    return {k: v for k, v in env.items() if os.environ.get(k) != v and k not in ("_", "SHLVL", "PWD", "OLDPWD")}
