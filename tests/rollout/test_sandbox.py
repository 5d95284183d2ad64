"""The code-execution tool's limits (megaforge.rollout.sandbox): wall-time timeout, memory cap, no shell
and no subprocesses, an isolated and deleted working directory, no network, a scrubbed environment."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from megaforge.rollout import sandbox
from megaforge.rollout.sandbox import run_code
from megaforge.rollout.tools import PythonTool


def test_runs_code_and_returns_stdout():
    r = run_code("import math\nprint(6 * 7, math.factorial(5))")
    assert r.ok and r.stdout == "42 120\n" and not r.timed_out


def test_timeout_kills_the_process_group():
    t = time.monotonic()
    r = run_code("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and not r.ok and "TimeoutError" in r.stderr
    assert time.monotonic() - t < 10
    # a sleeping child (no CPU used, so RLIMIT_CPU would never fire) is killed by the wall clock too
    r = run_code("import time\ntime.sleep(60)", timeout_s=1.0)
    assert r.timed_out


def test_memory_limit():
    r = run_code("x = bytearray(1024 ** 3)\nprint('allocated')", memory_mb=256)
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert run_code("x = bytearray(16 * 1024 ** 2)\nprint(len(x))", memory_mb=256).stdout == f"{16 * 1024 ** 2}\n"


def test_no_shell_argument_list_only(monkeypatch):
    seen = []
    real = subprocess.Popen

    def spy(args, *a, **kw):
        seen.append((args, kw.get("shell", False)))
        return real(args, *a, **kw)

    monkeypatch.setattr(sandbox.subprocess, "Popen", spy)
    code = "print('hi'); import os\n# $(touch /tmp/pwned) `id` ; rm -rf /"
    run_code(code)
    (args, shell), = seen
    assert shell is False and isinstance(args, list) and args[0] == sys.executable
    assert not any(code in a or "$(" in a for a in args)  # the code never reaches the command line


@pytest.mark.parametrize("code,event", [
    ("import os\nos.system('echo pwned')", "os.system"),
    ("import subprocess\nsubprocess.run(['echo', 'pwned'])", "subprocess.Popen"),
    ("import os\nos.fork()", "os.fork"),
    ("import os\nos.execv('/bin/sh', ['sh'])", "os.exec"),
    ("import ctypes\nctypes.CDLL(None).system(b'echo pwned')", "ctypes.dlopen"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 1))", "socket.__new__"),
])
def test_blocked_operations(code, event):
    r = run_code(code)
    assert not r.ok and "pwned" not in r.stdout and f"sandbox: {event} is not allowed" in r.stderr, r.stderr


def test_no_network_even_to_a_local_listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = []
    th = threading.Thread(target=lambda: got.append(srv.accept()), daemon=True)
    th.start()
    r = run_code(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    time.sleep(0.2)
    srv.close()
    assert "connected" not in r.stdout and not got


def test_isolated_working_directory_and_environment(tmp_path):
    os.environ["MEGAFORGE_TEST_SECRET"] = "hunter2"
    try:
        r = run_code("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\n"
                     "print(os.environ.get('MEGAFORGE_TEST_SECRET'))\nprint(sorted(os.listdir('.')))")
    finally:
        del os.environ["MEGAFORGE_TEST_SECRET"]
    cwd, secret, listing = r.stdout.splitlines()
    assert r.ok and cwd.startswith(os.path.realpath(os.environ.get("TMPDIR", "/tmp"))) and "megaforge-sandbox-" in cwd
    assert secret == "None" and "scratch.txt" in listing
    assert not os.path.exists(cwd)  # deleted afterwards
    target = tmp_path / "escape.txt"
    r = run_code(f"open({str(target)!r}, 'w').write('x')")
    assert not r.ok and "outside the sandbox directory" in r.stderr and not target.exists()
    r = run_code(f"import os\nos.remove({str(tmp_path)!r})")
    assert not r.ok and "outside the sandbox directory" in r.stderr


def test_output_is_bounded():
    r = run_code("print('x' * 100000)", max_output_bytes=1000)
    assert len(r.stdout) == 1000 and r.truncated


def test_python_tool_answers_output_or_error():
    tool = PythonTool(timeout_s=2.0, memory_mb=256)
    assert tool("print(sum(range(10)))") == "45"
    assert tool("```python\nprint(2 ** 10)\n```") == "1024"
    assert tool("1/0") == "error: ZeroDivisionError: division by zero"
    assert tool("while True: pass").startswith("error: TimeoutError")
    assert tool("import os; os.system('id')") == "error: PermissionError: sandbox: os.system is not allowed"
