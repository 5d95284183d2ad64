"""Running untrusted code (a model's tool call) in a subprocess with time, memory and access limits.

    res = run_code("print(6 * 7)", timeout_s=5, memory_mb=512)   # res.stdout == "42\\n"

* No shell, ever: the child is started from an argument list ``[python, -I, _sandbox_child.py,
  limits...]``; the code never becomes part of a command line, it is written to ``main.py`` in a fresh
  temporary directory that is the child's working directory (deleted afterwards).
* The child (:mod:`megaforge.rollout._sandbox_child`, standard library only) applies, before the code
  runs: ``RLIMIT_AS`` (memory_mb), ``RLIMIT_CPU`` (cpu seconds), ``RLIMIT_FSIZE`` (file_mb, which also
  bounds its stdout/stderr files), ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0, ``RLIMIT_NPROC`` 0; a new network
  namespace when the kernel grants one; it drops root to ``nobody``; and a PEP 578 audit hook that
  refuses sockets, subprocesses, exec/fork/spawn, ``os.system``, ctypes, signals to other processes,
  changing resource limits, and writing, deleting or renaming files outside its directory. (Reads
  are not restricted: run it where the files the process can read are not secret.)
* The parent kills the child's whole process group after ``timeout_s`` wall seconds.
* The child's environment is minimal (nothing inherited: no API keys or tokens reach the code).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
NOBODY = 65534


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    truncated: bool

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


def run_code(code: str, timeout_s: float = 5.0, memory_mb: int = 512, cpu_s: int | None = None,
             max_output_bytes: int = 4096, file_mb: int = 16) -> SandboxResult:
    """Run Python source ``code`` in a sandboxed subprocess; see the module docstring."""
    if not isinstance(code, str):
        raise TypeError("run_code: code must be a str")
    cpu = int(cpu_s if cpu_s is not None else max(1, int(timeout_s) + 1))
    d = tempfile.mkdtemp(prefix="megaforge-sandbox-")
    try:
        with open(os.path.join(d, "main.py"), "w") as f:
            f.write(code)
        if os.getuid() == 0:  # the child drops to nobody: it must own its directory
            for p in (d, os.path.join(d, "main.py")):
                os.chown(p, NOBODY, NOBODY)
        argv = [sys.executable, "-I", CHILD, "main.py", str(int(memory_mb) << 20), str(cpu), str(int(file_mb) << 20)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": d, "TMPDIR": d, "PYTHONHASHSEED": "0"}
        with open(os.path.join(d, ".stdout"), "wb") as out, open(os.path.join(d, ".stderr"), "wb") as err:
            proc = subprocess.Popen(argv, cwd=d, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        stdout, t1 = _read(os.path.join(d, ".stdout"), max_output_bytes)
        stderr, t2 = _read(os.path.join(d, ".stderr"), max_output_bytes)
        if timed_out:
            stderr += f"\nTimeoutError: the code ran longer than {timeout_s:g} s"
        return SandboxResult(stdout, stderr, proc.returncode, timed_out, t1 or t2)
    finally:
        shutil.rmtree(d, ignore_errors=True)
