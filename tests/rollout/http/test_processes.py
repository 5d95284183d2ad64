"""Engine server processes and their launch: no orphans (parent SIGKILL / SIGTERM), readiness errors with the log tail,
API-key rules on a non-loopback bind, GPU assignment, the sglang extra."""
from __future__ import annotations

import importlib.util
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from engine_helpers import ROOT, engine_config, http
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(240)

PARENT = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {root!r})
    from megaforge.rollout.http.processes import ServerProcess
    from megaforge.supervise import child_env
    kind, arg, log = sys.argv[1:4]
    stop = []
    if arg == "graceful":  # the program handles SIGTERM itself, like the RL loop
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    if kind == "engine":
        cmd = lambda port, fd: [sys.executable, "-m", "megaforge.rollout.server", "--model", arg, "--port", str(port),
                                "--sock-fd", str(fd)]
        s = ServerProcess("engine_0", cmd, log, env=child_env(), hold_socket=True)
    else:
        cmd = lambda port, fd: [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        s = ServerProcess("http", cmd, log, env=child_env(), probe="/")
    s.start_ready(120)
    print(s.pid, s.url, flush=True)
    for _ in range(6000):
        if stop:
            print("stopping; server alive:", s.alive(), flush=True)
            sys.exit(0)  # atexit stops the server
        time.sleep(0.1)
""")


def _start_parent(tmp_path, kind: str, arg: str):
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(root=ROOT))
    parent = subprocess.Popen([sys.executable, str(script), kind, arg, str(tmp_path / "server.log")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 150
    line = ""
    while time.time() < deadline and parent.poll() is None:
        if select.select([parent.stdout], [], [], 1.0)[0]:
            line = parent.stdout.readline()
            if line.strip() and line.split()[0].isdigit():
                break
    else:
        parent.kill()
        pytest.fail(f"the parent never reported its server: {line} {parent.stdout.read() if parent.poll() is not None else ''}")
    pid, url = line.split()[:2]
    return parent, int(pid), url


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_server_dies_when_parent_is_sigkilled(tmp_path, tiny_model_dir):
    parent, pid, url = _start_parent(tmp_path, "engine", tiny_model_dir)
    try:
        assert http(url, "GET", "/health_generate")[0] == 200
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _gone(pid, 5.0), f"engine server {pid} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


def test_servers_stopped_when_parent_gets_sigterm(tmp_path):
    parent, pid, url = _start_parent(tmp_path, "http", "")
    try:
        assert http(url, "GET", "/")[0] == 200
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(20) == -signal.SIGTERM  # our handler stopped the servers, then SIGTERM's default ran
        assert _gone(pid, 5.0)
    finally:
        parent.kill()
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


def test_program_sigterm_handler_is_kept_and_atexit_stops_servers(tmp_path):
    parent, pid, url = _start_parent(tmp_path, "http", "graceful")
    try:
        parent.send_signal(signal.SIGTERM)
        out, _ = parent.communicate(timeout=30)
        assert parent.returncode == 0 and "server alive: True" in out  # not killed under the program's feet
        assert _gone(pid, 5.0)
    finally:
        parent.kill()
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


def test_readiness_timeout_reports_log_tail_and_kills(tmp_path):
    from megaforge.rollout.http.processes import ServerProcess, ServerStartError
    from megaforge.supervise import child_env

    cmd = lambda port, fd: [sys.executable, "-c", "print('loading shard 3 of 7', flush=True); import time; time.sleep(120)"]
    s = ServerProcess("engine_0", cmd, str(tmp_path / "logs" / "engine_0.log"), env=child_env())
    with pytest.raises(ServerStartError) as e:
        s.start_ready(timeout_s=3.0)
    assert "not ready within 3 s" in str(e.value) and "loading shard 3 of 7" in str(e.value)
    assert not s.alive()


def test_early_exit_reports_exit_code_and_log_tail(tmp_path):
    from megaforge.rollout.http.processes import ServerProcess, ServerStartError
    from megaforge.supervise import child_env

    cmd = lambda port, fd: [sys.executable, "-m", "megaforge.rollout.server", "--model", str(tmp_path / "nope"),
                            "--port", str(port), "--sock-fd", str(fd)]
    s = ServerProcess("engine_0", cmd, str(tmp_path / "engine_0.log"), env=child_env(), hold_socket=True)
    with pytest.raises(ServerStartError) as e:
        s.start_ready(timeout_s=60.0)
    assert "exited with code 2" in str(e.value) and "no config.json" in str(e.value)


def test_known_start_failure_names_the_config_key_to_change(tmp_path):
    # the last line SGLang 0.5.16 logs on an H200 whose sgl_kernel has no FA3 (the server then exits)
    from megaforge.rollout.http.processes import ServerProcess, ServerStartError
    from megaforge.supervise import child_env

    fa3 = "ImportError: Can not import FA3 in sgl_kernel. Please check your installation."
    cmd = lambda port, fd: [sys.executable, "-c", f"print({fa3!r}, flush=True); raise SystemExit(1)"]
    s = ServerProcess("engine_0", cmd, str(tmp_path / "engine_0.log"), env=child_env())
    with pytest.raises(ServerStartError) as e:
        s.start_ready(timeout_s=60.0)
    assert fa3 in str(e.value) and "hint:" in str(e.value) and "--attention-backend triton" in str(e.value)
    assert "rollout.extra_args" in str(e.value)


def test_non_loopback_bind_needs_api_key_and_admin_needs_token(tmp_path, tiny_model_dir):
    from megaforge.net import free_port
    from megaforge.rollout.http.processes import ServerProcess
    from megaforge.supervise import child_env
    from megaforge.rollout.http.auth import API_KEY_ENV

    refused = subprocess.run([sys.executable, "-m", "megaforge.rollout.server", "--model", tiny_model_dir, "--host",
                              "0.0.0.0", "--port", str(free_port())], env=child_env({API_KEY_ENV: ""}),
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--api-key" in refused.stderr
    key = "k3y-for-the-test-0123"
    cmd = lambda port, fd: [sys.executable, "-m", "megaforge.rollout.server", "--model", tiny_model_dir, "--host",
                            "0.0.0.0", "--port", str(port), "--sock-fd", str(fd)]
    s = ServerProcess("engine_0", cmd, str(tmp_path / "engine_0.log"), host="0.0.0.0",
                      env=child_env(extra={API_KEY_ENV: key}), hold_socket=True, api_key=key)
    s.start_ready(120)
    try:
        url = s.url
        assert http(url, "GET", "/health")[0] == 200 and http(url, "GET", "/health_generate")[0] == 200
        for path, body in (("/release_memory_occupation", {}), ("/update_weights_from_disk", {"model_path": tiny_model_dir}),
                           ("/abort_request", {"abort_all": True}), ("/flush_cache", None), ("/pause_generation", {}),
                           ("/begin_weight_update", {}), ("/init_weights_update_group", {})):
            for token in (None, "wrong-token-0000"):
                st, out = http(url, "POST", path, body, token=token)
                assert st == 401 and out == {"error": "Unauthorized"}, (path, token, st, out)
        assert http(url, "GET", "/get_server_info")[0] == 401  # with a key, only /health* is open (as SGLang)
        assert http(url, "GET", "/get_server_info", token=key)[1]["released_memory"] == []  # nothing happened
        assert http(url, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}, token=key)[0] == 200
        assert http(url, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}, token=key)[0] == 200
        # beyond loopback without --weight-root nothing is readable from disk (issue 21, item 5)
        st, out = http(url, "POST", "/update_weights_from_disk", {"model_path": tiny_model_dir}, token=key)
        assert st == 403 and "--weight-root" in out["message"] and "rollout.weight_roots" in out["message"], out
        assert key not in open(s.log_path).read()  # the key travels in the environment, not argv
    finally:
        s.stop()
    assert not s.alive()


def test_non_loopback_server_reads_weights_only_under_its_roots(tmp_path, tiny_model_dir):
    """Issue 21, item 5: --weight-root bounds /update_weights_from_disk (symbolic links resolved)."""
    import shutil

    from megaforge.rollout.http.processes import ServerProcess
    from megaforge.supervise import child_env
    from megaforge.rollout.http.auth import API_KEY_ENV

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(tiny_model_dir, allowed / "ckpt")
    shutil.copytree(tiny_model_dir, outside / "ckpt")
    (allowed / "link").symlink_to(outside / "ckpt")
    (allowed / "half").mkdir()
    for f in os.listdir(allowed / "ckpt"):  # a folder inside whose weight file links outside
        if f.endswith(".safetensors"):
            (allowed / "half" / f).symlink_to(outside / "ckpt" / f)
    key = "k3y-for-the-test-0123"
    cmd = lambda port, fd: [sys.executable, "-m", "megaforge.rollout.server", "--model", tiny_model_dir, "--host",
                            "0.0.0.0", "--port", str(port), "--sock-fd", str(fd), "--weight-root", str(allowed)]
    s = ServerProcess("engine_0", cmd, str(tmp_path / "engine_0.log"), host="0.0.0.0",
                      env=child_env(extra={API_KEY_ENV: key}), hold_socket=True, api_key=key)
    s.start_ready(120)
    try:
        disk = lambda p: http(s.url, "POST", "/update_weights_from_disk", {"model_path": str(p)}, token=key)  # noqa: E731
        st, out = disk(allowed / "ckpt")
        assert st == 200 and out["success"], out
        for p in (outside / "ckpt", allowed / "link", allowed / "half", tmp_path / "*", "/etc", allowed / ".." / "outside"):
            st, out = disk(p)
            assert st == 403 and out["success"] is False and "--weight-root" in out["message"], (p, out)
        st, out = disk(allowed / "*")  # inside the root, but a glob is a literal name: no such directory
        assert st == 400 and "not a directory" in out["message"], out
    finally:
        s.stop()


def test_weight_roots_of_a_non_loopback_launch(tmp_path, tiny_model_dir):
    import tempfile

    from megaforge.rollout.http.start import weight_roots

    def roots(cfg):  # as build_http_engine asks
        spec = RunBuilder(cfg).engine_spec()
        return weight_roots(spec.rollout.weight_roots, spec.rollout.snapshot_dir, spec.transport == "disk",
                            spec.rollout.max_restarts)

    cfg = engine_config(tmp_path, tiny_model_dir, host="0.0.0.0", weight_roots=[str(tmp_path / "mine")])
    assert roots(cfg) == [str(tmp_path / "mine"), tempfile.gettempdir()]  # + default snapshots' folder
    cfg = engine_config(tmp_path, tiny_model_dir, host="0.0.0.0", snapshot_dir=str(tmp_path / "snap"))
    assert roots(cfg) == [str(tmp_path / "snap")]


def test_gpu_assignment():
    from megaforge.rollout.http.start import gpu_assignment

    assert gpu_assignment(2, 2, 0, 4, [0, 1, 2, 3]) == [[0, 1], [2, 3]]  # colocated
    assert gpu_assignment(2, 1, 2, 2, [4, 5, 6, 7]) == [[6], [7]]  # the node's last 2 GPUs, mapped
    assert gpu_assignment(1, 2, 2, 4, list(range(8))) == [[6, 7]]
    with pytest.raises(ValueError, match="do not fit"):
        gpu_assignment(1, 2, 2, 3, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="rollout.num_gpus"):
        gpu_assignment(3, 1, 2, 2, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="visible"):
        gpu_assignment(2, 2, 0, 1, [0, 1])


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_engine_without_sglang_names_the_extra(tmp_path, tokenizer, tiny_model_dir):
    from megaforge.configtree import ConfigError
    from megaforge.rollout import build_engine

    cfg = engine_config(tmp_path, tiny_model_dir, engine="sglang")
    for fn in (lambda: RunBuilder(cfg).preflight(), lambda: build_engine(RunBuilder(cfg).engine_spec(), tokenizer)):
        with pytest.raises(ConfigError, match=r"pip install 'megaforge\[sglang\]'.*sglang==0\.5\.23"):
            fn()
    assert not os.path.exists(os.path.join(cfg.run_dir, "logs", "engine_0.log"))  # nothing was launched
    # the launcher stops at start-up, before any SFT step or run directory
    from megaforge.launch import main

    with pytest.raises(SystemExit) as e:
        main("grpo", ["--model.path", tiny_model_dir, "--data.path", "arithmetic", "--data.format", "synthetic",
                      "--rollout.engine", "sglang", "--sft.max_steps", "5", "--output_dir", str(tmp_path / "runs"),
                      "--run_name", "x"])
    assert e.value.code == 1 and not os.path.exists(tmp_path / "runs" / "x")
