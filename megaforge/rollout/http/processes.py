"""Engine server processes: command lines, GPUs, ports, logs, readiness, and no orphans.

:class:`ServerProcess` runs one server command:

* its own process group (``start_new_session``), so stopping it stops everything it spawned;
* ``PR_SET_PDEATHSIG = SIGKILL`` set in the child, spawned from a thread that lives as long as the
  process (:mod:`megaforge.supervise`): if the parent dies, even by SIGKILL, the kernel kills the server;
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

Every started process is registered with its :class:`megaforge.supervise.Children` (by default the
process's own, :data:`megaforge.supervise.PROCESS_CHILDREN`) and stopped (SIGTERM to its group, SIGKILL
after a grace period) by :meth:`ServerProcess.stop` (``Engine.shutdown``), or, when the program ends
without that, by the registry's ``atexit`` hook and SIGTERM/SIGHUP handlers (see there).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

from megaforge.net import connect_host, free_port
from megaforge.supervise import PROCESS_CHILDREN, Children, preexec, stop_group

_ADDR_IN_USE = re.compile(r"address already in use|errno 98|EADDRINUSE", re.IGNORECASE)


class ServerStartError(RuntimeError):
    pass


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


class ServerProcess:
    """One server subprocess. ``make_cmd(port, sock_fd)`` builds its command line."""

    def __init__(self, name: str, make_cmd: Callable[[int, Optional[int]], list[str]], log_path: str, host: str = "127.0.0.1",
                 env: Optional[dict] = None, hold_socket: bool = False, api_key: str = "", probe: str = "/health_generate",
                 children: Optional[Children] = None):
        self.name, self.make_cmd, self.log_path, self.host = name, make_cmd, log_path, host
        self.children = PROCESS_CHILDREN if children is None else children  # who stops it if its owner does not
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
                self.proc = self.children.spawn(lambda: subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                    start_new_session=True, preexec_fn=preexec(os.getpid()), pass_fds=(sock.fileno(),) if sock else ()))
        finally:
            if sock is not None:
                sock.close()  # the child holds its own copy
        self.children.add(self)
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
        self.children.discard(self)
        if self.proc is not None:
            stop_group(self.proc, grace_s)

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
