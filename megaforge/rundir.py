"""The run directory: one writer at a time, and its set-up.

    lock = claim(run_dir, resume, write_config)   # main rank, before anything is written
    ...
    lock.release()                                # also when the process ends, however it ends

One writer: an exclusive ``flock`` on ``<run dir>/.lock``, held for the run's life by its main
rank; a second run or ``--resume`` of the directory fails naming the holder's ``pid@host``.

The lock file holds the holder's ``pid@host``; it is left in place (an unlocked file means nothing).
It is opened with ``O_NOFOLLOW`` and without truncation, and must be a regular file: a ``.lock``
that is a symlink (or a fifo, a device, a directory) is refused, naming it, before anything is
written (a planted link would otherwise truncate its target).
``flock`` is advisory and per open file: it holds against every megaforge process, on this host,
and on network filesystems that implement it (NFSv4, Lustre and GPFS do; check yours).
"""
from __future__ import annotations

import fcntl
import os
import socket
import stat
from typing import Callable

from megaforge.checkpoint import list_checkpoints


class RunDirError(RuntimeError):
    """The run directory cannot be used (nothing in it was changed)."""


class RunDirBusy(RunDirError):
    """Another process holds the run directory."""


class RunDirLock:
    fd = None  # until the lock is taken (a refused lock's __del__ has nothing to release)

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, ".lock")
        fd = self._open(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "an unknown process"
            os.close(fd)
            raise RunDirBusy(f"run directory {run_dir} is in use by process {holder} (it holds {self.path}); "
                             f"two runs must not write one directory: wait for it to end or stop it, or choose "
                             f"another --run_name / --output_dir (nothing was changed)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    @staticmethod
    def _open(path: str) -> int:
        """``path`` opened read-write, created when missing; never through a symlink, never a
        non-regular file (O_NONBLOCK: a planted fifo does not block the open)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            kind = "a symlink" if os.path.islink(path) else "not a regular file" if os.path.lexists(path) else None
            why = kind or e.strerror
            raise RunDirError(f"run directory lock {path} is {why}: remove it (nothing was changed)"
                              if kind else f"run directory lock {path}: {why} (nothing was changed)") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RunDirError(f"run directory lock {path} is not a regular file: remove it (nothing was changed)")
        return fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __del__(self):
        self.release()


def claim(run_dir: str, resume: bool, write_config: Callable[[str], None]) -> RunDirLock:
    """Lock ``run_dir``; refuse a directory that already holds a run unless ``resume``; create
    ``checkpoints/``, ``logs/``, ``hf/`` and write ``config.yaml`` through ``write_config(path)``."""
    lock = RunDirLock(run_dir)
    has_run = os.path.exists(os.path.join(run_dir, "metrics.jsonl")) or list_checkpoints(
        os.path.join(run_dir, "checkpoints"))
    if has_run and not resume:
        lock.release()
        raise RunDirError(f"run directory {run_dir} already holds a run: pass --resume to continue it, or "
                          f"choose another --run_name / --output_dir (nothing was changed)")
    for sub in ("checkpoints", "logs", "hf"):
        os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
    write_config(os.path.join(run_dir, "config.yaml"))
    return lock
