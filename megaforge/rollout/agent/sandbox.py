"""Running untrusted code (a model's tool call) in a kernel-enforced sandbox.

    res = run_code("print(6 * 7)", timeout_s=5, memory_mb=512)   # res.stdout == "42\\n"

The boundary is the kernel's, not Python's (a PEP 578 audit hook is no sandbox: the code can switch
it off). Every call starts :mod:`megaforge.rollout.agent.sandbox_child` from an argument list (no
shell; the code is a file, never part of a command line), which puts the code in

* its own **user, mount, PID, network and IPC namespaces**;
* an **unprivileged uid** (when the trainer runs as root: ``SANDBOX_UID_BASE + pid``, a uid no file
  or process on the machine has, one per live sandbox; otherwise the trainer's own uid), with no
  supplementary groups (as root), no capabilities and ``no_new_privs`` (setuid binaries do not lift
  it), so ``RLIMIT_NPROC`` binds;
* a **read-only view of the filesystem**: every mount remounted read-only/nosuid/nodev; ``/root``,
  ``/home`` and the trainer's home hidden (the interpreter's own directories bound back read-only);
  ``/dev/shm``, ``/var/tmp``, ``/run/lock`` empty and read-only; ``/tmp`` a private tmpfs of
  ``scratch_mb`` that is the code's working directory and its only writable place (gone afterwards);
* its **own /proc** (only its own processes: the trainer's ``/proc/<pid>/environ`` does not exist
  there) and a **clean environment** (nothing inherited: no API keys or tokens);
* **no network** (an empty network namespace);
* **resource limits**: ``RLIMIT_AS`` (memory_mb), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (file_mb; it
  also bounds stdout/stderr), ``RLIMIT_NOFILE`` 64, no core files, ``RLIMIT_NPROC`` (no process
  besides itself unless ``max_processes``), no POSIX message queues; and a **seccomp filter**
  refusing the memory RLIMIT_AS does not count (SysV shared memory, message queues, semaphores,
  memfds): what the code holds is at most ``memory_mb`` + ``scratch_mb`` (x86_64 and aarch64);
* a **wall-clock deadline** that kills the whole process tree: the code runs as PID 1 of its PID
  namespace, so killing it makes the kernel kill every process it started (``setsid`` does not
  escape a PID namespace), and the call returns only after all of them are gone.

Reads are limited by the uid's permissions and the hidden directories; world-readable files stay
readable. When the kernel does not grant the namespaces (unprivileged user namespaces disabled, a
container's seccomp profile), :func:`run_code` raises :class:`SandboxUnavailable` naming the step
that failed: there is no weaker fallback (bubblewrap / nsjail are not used). An interpreter that
cannot be started inside the sandbox is a :class:`SandboxUnavailable` naming it (never a timeout).
:func:`require` checks once and logs the isolation in use.
"""
from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megaforge.rollout.agent import sandbox_child as child

CHILD = os.path.abspath(child.__file__)
SANDBOX_UID_BASE = 2_000_000_000  # + the sandbox's pid (< 2**22): below 2**31, far from real accounts
SETUP_TIMEOUT_S = 30.0  # interpreter start and namespace set-up, on a loaded machine
TEARDOWN_GRACE_S = 10.0
# RLIMIT_NPROC counts threads too: numerical libraries start one thread per core unless told not to
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")  # after the deadline: the namespace's processes are reaped
HINT = ("the kernel refused the sandbox's namespaces; allow unprivileged user namespaces "
        "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, on Ubuntu "
        "kernel.apparmor_restrict_unprivileged_userns=0) or, in a container, a seccomp profile that permits "
        "unshare/mount; megaforge runs no code without this isolation")


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be set up on this machine; no code ran."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    truncated: bool
    isolation: str = ""  # what the child set up (namespaces, uid, filesystem)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _read(path: str, limit: int) -> tuple[str, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return "", False
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


class _StatusLines:
    """Lines the child writes on the status pipe, read with a deadline."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""

    def next(self, timeout_s: float):
        """The next line, '' at end of file, None when nothing came within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("utf-8", "replace")


def interpreter() -> str:
    """The interpreter the sandbox runs: ``sys.executable`` with its folder's symlinks resolved (the
    sandbox binds resolved folders back, so a virtualenv reached through a linked folder is found
    there), the file name kept (a virtualenv's ``bin/python`` link finds its ``pyvenv.cfg``)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


def _interpreter_dirs() -> list[str]:
    """Directories the sandboxed interpreter must read (its prefixes and executable's folder)."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                          os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(d for d in dirs if not any(d != o and child.under(d, o) for o in dirs))


def _hidden_dirs(keep: list[str]) -> list[str]:
    """``/root``, ``/home``, the trainer's home, and whatever directory keeps the sandbox uid from
    the interpreter (it is hidden too, and the interpreter's folders are bound back)."""
    uid = os.geteuid()
    sandbox_uid, gids = (-1, set()) if uid == 0 else (uid, set(os.getgroups()) | {os.getegid()})
    hidden = {"/root", "/home", os.path.realpath(os.path.expanduser("~"))}
    for d in keep:
        blocked = child.blocked_ancestor(d, sandbox_uid, gids)
        if blocked:
            hidden.add(blocked)
    hidden.discard("/")
    return sorted(hidden, key=lambda p: (p.count("/"), p))


def _map_ids(pid: int) -> tuple[int, int]:
    """Write the child's user-namespace maps: one uid and one gid, mapped to themselves."""
    if os.geteuid() == 0:
        uid = gid = SANDBOX_UID_BASE + pid
    else:
        uid, gid = os.geteuid(), os.getegid()
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(text)
        except OSError as e:
            raise SandboxUnavailable(f"sandbox set-up failed: writing /proc/{pid}/{name}: {e}; {HINT}") from None
    return uid, gid


def run_code(code: str, timeout_s: float = 5.0, memory_mb: int = 512, cpu_s: int | None = None,
             max_output_bytes: int = 4096, file_mb: int = 16, scratch_mb: int = 64,
             max_processes: int = 0) -> SandboxResult:
    """Run Python source ``code`` in the sandbox (module docstring); raise SandboxUnavailable when
    the machine cannot provide it."""
    if not isinstance(code, str):
        raise TypeError("run_code: code must be a str")
    d = tempfile.mkdtemp(prefix="megaforge-sandbox-")
    status_r, status_w = os.pipe()
    ctl_r, ctl_w = os.pipe()
    proc = None
    try:
        with open(os.path.join(d, "main.py"), "w") as f:
            f.write(code)
        keep = _interpreter_dirs()
        args = {"script": os.path.join(d, "main.py"), "status_fd": status_w, "ctl_fd": ctl_r,
                "keep": keep, "hidden": _hidden_dirs(keep), "timeout_s": float(timeout_s),
                "memory_bytes": int(memory_mb) << 20, "cpu_s": int(cpu_s if cpu_s is not None else int(timeout_s) + 1),
                "file_bytes": int(file_mb) << 20, "scratch_bytes": int(scratch_mb) << 20,
                "max_processes": int(max_processes), "interpreter": interpreter(),
                "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp",
                        "PYTHONHASHSEED": "0", **{k: "1" for k in THREAD_VARS}}}
        argv = [sys.executable, "-I", CHILD, json.dumps(args)]
        with open(os.path.join(d, ".stdout"), "wb") as out, open(os.path.join(d, ".stderr"), "wb") as err:
            proc = subprocess.Popen(argv, cwd=d, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True,
                                    pass_fds=(status_w, ctl_r), start_new_session=True)
        os.close(status_w)
        os.close(ctl_r)
        status_w = ctl_r = -1
        lines = _StatusLines(status_r)
        isolation = _set_up(proc, lines, ctl_w, d)
        final = lines.next(timeout_s + TEARDOWN_GRACE_S)  # None: the child itself hung (killed below)
        if final and final.startswith("error "):  # the interpreter could not be started: nothing ran
            raise SandboxUnavailable(f"sandbox set-up failed: {final[6:]}")
        returncode, timed_out = -signal.SIGKILL, True
        if final and final.startswith("exit "):
            _, wstatus, flag = final.split()
            returncode, timed_out = os.waitstatus_to_exitcode(int(wstatus)), flag == "1"
            try:
                proc.wait(timeout=TEARDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                pass  # killed below
        stdout, t1 = _read(os.path.join(d, ".stdout"), max_output_bytes)
        stderr, t2 = _read(os.path.join(d, ".stderr"), max_output_bytes)
        if timed_out:
            stderr += f"\nTimeoutError: the code ran longer than {timeout_s:g} s"
        return SandboxResult(stdout, stderr, returncode, timed_out, t1 or t2, isolation)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's death kills P1 (PR_SET_PDEATHSIG), hence all
            proc.wait()
        for fd in (status_r, status_w, ctl_r, ctl_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(d, ignore_errors=True)


def _set_up(proc, lines: _StatusLines, ctl_w: int, d: str) -> str:
    """The hand-shake: the child unshared -> its uid/gid maps written -> it reports ready."""
    def fail(line) -> SandboxUnavailable:
        if line is None:
            why = f"no answer within {SETUP_TIMEOUT_S:g} s"
        elif line.startswith("error "):
            why = line[6:]
            if why.startswith("SetupError: the interpreter "):  # not the kernel's refusal: no namespace hint
                return SandboxUnavailable(f"sandbox set-up failed: {why}")
        else:
            err, _ = _read(os.path.join(d, ".stderr"), 2000)
            why = f"the sandbox process ended ({line or 'no status'}): {err.strip()[-500:]}"
        return SandboxUnavailable(f"sandbox set-up failed: {why}; {HINT}")

    line = lines.next(SETUP_TIMEOUT_S)
    if line != "unshared":
        raise fail(line)
    uid, gid = _map_ids(proc.pid)
    os.write(ctl_w, f"go {uid} {gid}\n".encode())
    line = lines.next(SETUP_TIMEOUT_S)
    if not line or not line.startswith("ready "):
        raise fail(line)
    return line[6:]


@functools.lru_cache(maxsize=1)
def _probe() -> str:
    try:
        res = run_code("print('ok')", timeout_s=30.0)
    except SandboxUnavailable as e:
        return "error: " + str(e)
    if res.stdout != "ok\n":
        return f"error: the sandbox ran but a trivial program failed: {res.stderr.strip()[-500:]}"
    return res.isolation


def unavailable_reason() -> str | None:
    """None when the sandbox works on this machine, else why it does not (checked once)."""
    got = _probe()
    return got[len("error: "):] if got.startswith("error: ") else None


@functools.lru_cache(maxsize=1)
def _log_isolation(isolation: str) -> None:
    print(f"[megaforge] code sandbox: {isolation} (bubblewrap/nsjail not used)", file=sys.stderr, flush=True)


def require() -> str:
    """The isolation in use (logged once); SandboxUnavailable when there is none."""
    why = unavailable_reason()
    if why:
        raise SandboxUnavailable(why)
    _log_isolation(_probe())
    return _probe()
