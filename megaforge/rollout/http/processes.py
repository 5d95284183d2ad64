"""Engine server processes: command lines, GPUs, ports, logs, readiness, and no orphans.

:class:`ServerProcess` runs one server command:

* its own process group (``start_new_session``), so stopping it stops everything it spawned;
* ``PR_SET_PDEATHSIG = SIGKILL`` set in the child (``preexec_fn``, Linux): if the parent dies, even by
  SIGKILL, the kernel kills the server. The signal follows the *thread* that started the child, so a
  server started from another thread (a restart inside a background ``generate``) is spawned by a
  process-long spawner thread, never by the short-lived caller;
* stdout and stderr appended to its log file (``<run dir>/logs/engine_K.log``), after a header with
  the command line (API keys redacted);
* a port chosen safely: the embedded server inherits a socket we bound and hold (``--sock-fd``), so no
  other process can take the port in between; SGLang gets a port picked by binding port 0, and is
  restarted on a fresh port when its log says the address was in use;
* restart (engine fault tolerance, :mod:`megaforge.rollout.http.recovery`): stop, a line saying why appended
  to the same log, start again on the same port when it can be bound again (so a router in front keeps
  its worker URL), else a fresh one;
* readiness: ``GET /health_generate`` (``/health`` for the router) polled until HTTP 200; a server
  that exits, or is not ready within the timeout, raises :class:`ServerStartError` with its exit code
  and the tail of its log (and is killed).

Every started process is registered and stopped (SIGTERM to its group, SIGKILL after a grace period)
by :meth:`ServerProcess.stop` (``Engine.shutdown``), an ``atexit`` hook, and, where the program leaves
SIGTERM/SIGHUP at their default (which would end it without ``atexit``), handlers that stop the
servers and then die by the signal as before. A program that handles SIGTERM itself (the RL loop's
graceful stop) keeps its handler: its exit path runs ``Engine.shutdown`` and ``atexit``.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import megaforge
from megaforge.net import connect_host, free_port

PR_SET_PDEATHSIG = 1
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megaforge.__file__)))
_ADDR_IN_USE = re.compile(r"address already in use|errno 98|EADDRINUSE", re.IGNORECASE)


class ServerStartError(RuntimeError):
    pass


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # resolved before any fork: the child only calls it


def die_with_parent(sig: int) -> None:
    """In a child before exec (``preexec_fn``): the kernel sends ``sig`` when the parent (thread) dies
    (``PR_SET_PDEATHSIG``, Linux; nothing elsewhere)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _preexec(parent_pid: int) -> Callable[[], None]:
    def run():
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    return run


def url_for(host: str, port: int) -> str:
    h = connect_host(host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


def bound_socket(host: str, port: int = 0) -> socket.socket:
    """A listening socket on ``port`` (0: a free one) of ``host``, to hand to the embedded server (bind
    and hold). SO_REUSEADDR, inherited by the accepted connections, lets a restarted server bind the
    port again while a dead server's connections linger (FIN_WAIT, TIME_WAIT); Linux still refuses a
    port another socket listens on."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def port_free(host: str, port: int) -> bool:
    """True when ``port`` of ``host`` can be bound now (SO_REUSEADDR, as servers bind)."""
    try:
        bound_socket(host, port).close()
        return True
    except OSError:
        return False


def redact(cmd: list[str]) -> list[str]:
    out, hide = [], False
    for a in cmd:
        out.append("***" if hide else a)
        hide = a in ("--api-key", "--admin-api-key")
    return out


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(lines[-n:])


# Start failures whose log line says what to change (the line as SGLang 0.5.16 writes it -> the remedy).
START_FAILURE_HINTS = (
    ("Can not import FA3 in sgl_kernel",
     "this sgl_kernel build has no FlashAttention-3 kernels (SGLang picks FA3 on Hopper by default): add "
     "--attention-backend triton (and --sampling-backend pytorch without FlashInfer) to rollout.extra_args"),
)


def start_failure_hint(log_tail: str) -> str:
    """The remedy for a known start failure found in ``log_tail``, as a sentence to append ('' if none)."""
    hints = [h for line, h in START_FAILURE_HINTS if line in log_tail]
    return "".join(f"\nhint: {h}" for h in hints)


_SPAWNER = None
_SPAWNER_LOCK = threading.Lock()


def _spawn(fn):
    """``fn()`` (a Popen) on the main thread, or on a spawner thread that lives as long as the process:
    PR_SET_PDEATHSIG fires when the thread that forked the child ends."""
    global _SPAWNER
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="megaforge-spawner")
    return _SPAWNER.submit(fn).result()


_LIVE: list["ServerProcess"] = []
_LIVE_LOCK = threading.Lock()
_HOOKED = False


def stop_all() -> None:
    """Stop every server process started here and still running."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for p in procs:
        p.stop(grace_s=5.0)


def _install_hooks() -> None:
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(stop_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit + PDEATHSIG still apply
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_DFL:
            continue  # the program handles it (e.g. the loop's graceful stop): its exit path stops the servers

        def handler(signum, frame):
            stop_all()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


class ServerProcess:
    """One server subprocess. ``make_cmd(port, sock_fd)`` builds its command line."""

    def __init__(self, name: str, make_cmd: Callable[[int, Optional[int]], list[str]], log_path: str, host: str = "127.0.0.1",
                 env: Optional[dict] = None, hold_socket: bool = False, api_key: str = "", probe: str = "/health_generate"):
        self.name, self.make_cmd, self.log_path, self.host = name, make_cmd, log_path, host
        self.env = dict(os.environ if env is None else env)
        self.hold_socket, self.api_key, self.probe = hold_socket, api_key, probe
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.want_port = 0  # a restart asks for the previous port first
        self.restarts = 0

    @property
    def url(self) -> str:
        return url_for(self.host, self.port)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "ServerProcess":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        want, self.want_port = self.want_port, 0  # only the first attempt: a retry takes a fresh port
        if want and not port_free(self.host, want):
            want = 0
        sock = bound_socket(self.host, want) if self.hold_socket else None
        try:
            self.port = sock.getsockname()[1] if sock else (want or free_port(self.host))
            cmd = self.make_cmd(self.port, sock.fileno() if sock else None)
            with open(self.log_path, "ab") as log:
                log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {' '.join(redact(cmd))}\n".encode())
                log.flush()
                self.proc = _spawn(lambda: subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                    start_new_session=True, preexec_fn=_preexec(os.getpid()), pass_fds=(sock.fileno(),) if sock else ()))
        finally:
            if sock is not None:
                sock.close()  # the child holds its own copy
        _install_hooks()
        with _LIVE_LOCK:
            _LIVE.append(self)
        return self

    def _ready_once(self) -> bool:
        req = urllib.request.Request(self.url + self.probe)
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=5.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                last = tail(self.log_path)
                raise ServerStartError(f"{self.name} exited with code {self.proc.returncode} before it was ready "
                                       f"({self.url}); last lines of {self.log_path}:\n{last}{start_failure_hint(last)}")
            if self._ready_once():
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise ServerStartError(f"{self.name} was not ready within {timeout_s:.0f} s ({self.url}{self.probe}); "
                                       f"last lines of {self.log_path}:\n{tail(self.log_path)}")
            time.sleep(poll_s)

    def start_ready(self, timeout_s: float, attempts: int = 3) -> "ServerProcess":
        """Start and wait until ready, restarting on a fresh port when the port was taken meanwhile."""
        for k in range(attempts):
            self.start()
            try:
                self.wait_ready(timeout_s)
                return self
            except ServerStartError as e:
                self.stop()
                if k + 1 < attempts and _ADDR_IN_USE.search(tail(self.log_path, 10)):
                    continue
                raise e
        raise AssertionError("unreachable")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``."""
        p = self.proc
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # also reaps anything the server left in its group
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass

    def note(self, line: str) -> None:
        """Append a line to the server's log (e.g. why it is restarted)."""
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {line}\n".encode())

    def restart(self, timeout_s: float, grace_s: float = 10.0, reason: str = "", same_port: bool = True,
                require_same_port: bool = False) -> "ServerProcess":
        """Stop (SIGTERM, SIGKILL after ``grace_s``: a hung or stopped server too) and start again,
        waiting for readiness; the log is appended to. ``same_port``: on the previous port when it can
        be bound again, else a fresh one (``require_same_port``: else ServerStartError, e.g. when a
        router holds the worker URL)."""
        old = self.port
        self.stop(grace_s)
        self.restarts += 1
        self.note(f"restart {self.restarts} (was pid {self.pid}, port {old}): {reason or 'requested'}")
        if same_port and old:
            if require_same_port and not port_free(self.host, old):
                raise ServerStartError(f"{self.name}: port {old} of {self.host} is taken by another process; the "
                                       f"restarted server must keep its URL (a router sends to it)")
            self.want_port = old
        return self.start_ready(timeout_s, attempts=1 if require_same_port else 3)


def start_all(servers: list[ServerProcess], timeout_s: float) -> list[ServerProcess]:
    """Start every server, then wait for all of them (they load in parallel); stop all on failure."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            try:
                s.wait_ready(timeout_s)
            except ServerStartError:
                if not _ADDR_IN_USE.search(tail(s.log_path, 10)):
                    raise
                s.start_ready(timeout_s)
    except BaseException:
        for s in servers:
            s.stop(grace_s=3.0)
        raise
    return servers


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
    """The environment of a server process: this one's, without torchrun's rendezvous variables
    (:data:`RENDEZVOUS_VARS`), with ``CUDA_VISIBLE_DEVICES`` set to ``gpus`` when given, megaforge's
    source tree first on ``PYTHONPATH`` when ``repo_on_path`` (the embedded server), then ``extra``
    (e.g. ``rollout.engine_env``: its ``PYTHONPATH`` replaces this process's)."""
    env = {k: v for k, v in os.environ.items() if not is_rendezvous_var(k)}
    if repo_on_path:
        env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    return env


def env_from_script(path: str) -> dict:
    """The environment variables a shell file sets or changes when sourced (e.g. an SGLang install's
    ``env.sh``), as a dict for ``rollout.engine_env``; this process's environment is not touched."""
    out = subprocess.run(["bash", "-c", 'set -a; . "$1" >/dev/null; env -0', "_", path], capture_output=True)
    if out.returncode != 0:
        raise RuntimeError(f"sourcing {path} failed (exit {out.returncode}): {out.stderr.decode()[-400:]}")
    env = dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if "=" in kv)
    return {k: v for k, v in env.items() if os.environ.get(k) != v and k not in ("_", "SHLVL", "PWD", "OLDPWD")}
