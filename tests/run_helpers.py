"""Helpers for tests that launch whole runs (as subprocesses, or in the test's process) and compare their metrics.jsonl."""
from __future__ import annotations

import json
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: metric prefixes that depend on wall time, not on the computation
VOLATILE = ("time/", "throughput/")


def lines(path: str) -> list[dict]:
    """The JSON records of a jsonl file ([] while it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def stable(recs: list[dict], volatile: tuple[str, ...] = VOLATILE) -> list[dict]:
    """The records without their wall-time-dependent keys."""
    return [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in recs]


def stop_when(proc, path: str, n: int, sig, timeout: float = 400) -> int:
    """Send ``sig`` to ``proc`` once ``path`` has ``n`` lines; the process's exit status."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(lines(path)) >= n:
            proc.send_signal(sig)
            return proc.wait(timeout=300)
        if proc.poll() is not None:
            raise AssertionError(f"run ended before {path} had {n} lines: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out waiting for {n} lines in {path}")


def run_in_process(mode: str, argv: list[str]) -> tuple[int, str, str]:
    """``megaforge.launch.main(mode, argv)`` in this process, which is what ``launchers/<mode>.py``
    runs, without a new interpreter's imports (a tiny CPU-demo run: ~1.5 s instead of ~7 s).
    It runs from the repository root (the configs' relative paths), as the tests' subprocess launches
    do. Returns (exit code, stdout, stderr) of the main process's own prints (not its engines' or
    reward workers'). What a run changes in the process is put back afterwards: the working
    directory, the handlers of the signals it installs, torch's deterministic mode and the global
    random states. For what needs a process of its own (a signal to the run, its exit with the
    interpreter, torchrun), launch one."""
    import contextlib
    import io
    import random
    import signal

    import numpy as np
    import torch

    from megaforge.launch import main

    sigs = [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT]
    handlers = {s: signal.getsignal(s) for s in sigs}
    deterministic = torch.are_deterministic_algorithms_enabled()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cwd = os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    rc = 0
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(mode, list(argv))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(cwd)
        for s, h in handlers.items():
            signal.signal(s, h)
        torch.use_deterministic_algorithms(deterministic)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    return rc, out.getvalue(), err.getvalue()


def completed_in_process(mode: str, argv: list[str]):
    """:func:`run_in_process` as a ``subprocess.CompletedProcess`` (returncode, stdout, stderr), for
    tests written against ``subprocess.run`` of a launcher."""
    import subprocess

    rc, out, err = run_in_process(mode, argv)
    return subprocess.CompletedProcess([mode, *argv], rc, out, err)
