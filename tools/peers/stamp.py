#!/usr/bin/env python
"""Record when each line of a growing log appeared: one JSON line ``{"line": N, "t": epoch seconds}`` per new
line of FILE, polled every ``--every`` seconds (so a time is late by at most that), until PID exits.
tools/peers/parse_logs.py turns these and the launch time into a system's start-up.

    python tools/peers/stamp.py FILE OUT --pid PID [--every 0.5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("out")
    p.add_argument("--pid", type=int, required=True, help="stop when this process is gone")
    p.add_argument("--every", type=float, default=0.5)
    a = p.parse_args(argv)
    seen = 0
    with open(a.out, "a") as out:
        while True:
            running = alive(a.pid)
            n = count_lines(a.file)
            t = time.time()
            for line in range(seen + 1, n + 1):
                out.write(json.dumps({"line": line, "t": t}) + "\n")
            out.flush()
            seen = max(seen, n)
            if not running:
                return 0
            time.sleep(a.every)


if __name__ == "__main__":
    sys.exit(main())
