"""Reward servers started by the tests: real processes on 127.0.0.1, a fresh port each."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), OMP_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", **extra)


@contextlib.contextmanager
def server(args: list[str], extra_env: dict | None = None, timeout: float = 120):
    """Start ``python ARGS`` (it prints ``... http://127.0.0.1:PORT/``), yield (url, process)."""
    p = subprocess.Popen([sys.executable, *args], env=env(**(extra_env or {})), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            line = p.stdout.readline()
            if not line:
                raise AssertionError(f"server {args} ended before serving: {p.stderr.read()[-3000:]}")
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            url = m.group(1) if m else None
            assert time.monotonic() < deadline, f"server {args} did not start"
        yield url, p
    finally:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def serve(*args, extra_env=None):
    """``python -m megaforge.rewards.serve --port 0 ARGS``."""
    return server(["-m", "megaforge.rewards.serve", "--port", "0", *args], extra_env)


def bad_server():
    return server([os.path.join(HERE, "bad_server.py")])


def post(url: str, body, token: str = "", raw: bytes | None = None) -> tuple[int, object]:
    """(status, parsed JSON or text) of one POST."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                           **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
