"""Helpers for tests that launch whole runs as subprocesses and compare their metrics.jsonl."""
from __future__ import annotations

import json
import os
import time

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
