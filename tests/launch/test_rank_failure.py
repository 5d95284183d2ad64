"""torchrun over two nodes (two agents on this machine, static rendezvous): each node's local rank 0
starts that node's engine server and rank 0 drives both; when one rank raises mid-run, the other
ranks and every engine server are gone within a bounded time (megaforge.cluster's watchdog, gloo's
closed connections, torchrun), and a hung rank (SIGSTOP: alive, silent) is detected by its stale
heartbeat."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--sft.max_steps", "2", "--max_steps", "3",
        "--rollout.batch_size", "4", "--grpo.n_samples", "2", "--rollout.max_new_tokens", "8",
        "--metrics.progress", "false", "--metrics.tensorboard", "false", "--metrics.log_samples", "0"]
BOUND_S = 30  # the other ranks must be gone this long after the failing rank's node ended


def env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + HERE, **extra)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nnodes, node_rank, nproc, port, args, log, **extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
           "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(port),
           os.path.join(ROOT, "launchers", "grpo.py"), *TINY, *args]
    return subprocess.Popen(cmd, env=env(**extra), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def servers_of(run_dir):
    """Engine server processes writing to this run's logs (their stdout is <run dir>/logs/engine_K.log)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "megaforge.rollout.server" in " ".join(p.info["cmdline"] or []):
                if os.readlink(f"/proc/{p.pid}/fd/1").startswith(os.path.join(run_dir, "logs")):
                    found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


def kill_tree(procs):
    for p in procs:
        if p.poll() is None:
            for q in [psutil.Process(p.pid)] + psutil.Process(p.pid).children(recursive=True):
                try:
                    q.kill()
                except psutil.Error:
                    pass
            p.wait(timeout=10)


def steps(path):
    return [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []


def test_rank_that_raises_ends_every_rank_and_engine(tmp_path):
    port = free_port()
    args = ["--rollout.engine", "embedded_server", "--rollout.num_engines", "2", "--rollout.device", "cpu",
            "--algo.loss", "launch_plugins:fail_on_rank", "--sft.max_steps", "0", "--output_dir", str(tmp_path), "--run_name", "f"]
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]
    fail = dict(MEGAFORGE_TEST_FAIL_RANK="1", MEGAFORGE_TEST_FAIL_CALL="2")  # rank 1, in RL step 2's loss
    procs = [torchrun(2, n, 1, port, args, logs[n], **fail) for n in (0, 1)]
    try:
        deadline = time.time() + 150
        while procs[1].poll() is None:
            assert time.time() < deadline, "node 1 never ended"
            time.sleep(0.1)
        t_failed = time.time()
        while procs[0].poll() is None:
            assert time.time() < t_failed + BOUND_S, f"node 0 still running {BOUND_S} s after node 1 failed"
            time.sleep(0.1)
        run = str(tmp_path / "f")
        t_gone = time.time()
        while servers_of(run):
            assert time.time() < t_gone + 15, f"engine servers left: {servers_of(run)}"
            time.sleep(0.2)
    finally:
        kill_tree(procs)
    out0, out1 = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert procs[1].returncode != 0 and procs[0].returncode != 0
    assert "injected failure on rank 1 (loss call 2)" in out1
    # node 1's local rank 0 started engine_1; rank 0 drove both engines for step 1
    line = next(ln for ln in out0.splitlines() if ln.startswith("[megaforge] engines:"))
    assert "engine_0 http://127.0.0.1:" in line and "(node 0," in line and "engine_1 http://127.0.0.1:" in line and "(node 1," in line
    port1 = line.split("engine_1 http://127.0.0.1:")[1].split()[0]
    assert f"--port {port1} " in (tmp_path / "f" / "logs" / "engine_1.log").read_text()
    assert steps(tmp_path / "f" / "metrics.jsonl") == [1]


def test_hung_rank_is_detected_by_its_heartbeat(tmp_path):
    port = free_port()
    args = ["--launch.heartbeat_s", "0.5", "--launch.peer_timeout_s", "5", "--max_steps", "40", "--sft.max_steps", "0",
            "--output_dir", str(tmp_path), "--run_name", "h"]
    log = open(tmp_path / "node.log", "w")
    proc = torchrun(1, 0, 2, port, args, log)
    try:
        deadline = time.time() + 150
        while not steps(tmp_path / "h" / "metrics.jsonl"):
            assert time.time() < deadline and proc.poll() is None, (tmp_path / "node.log").read_text()[-3000:]
            time.sleep(0.1)
        ranks = {int(psutil.Process(c.pid).environ().get("RANK", -1)): c for c in psutil.Process(proc.pid).children()}
        ranks[1].send_signal(signal.SIGSTOP)  # rank 1 hangs: alive (its sockets open), silent
        t0 = time.time()
        while ranks[0].is_running() and ranks[0].status() != psutil.STATUS_ZOMBIE:
            assert time.time() < t0 + 5 + 10, "rank 0 still running 15 s after rank 1 hung"
            time.sleep(0.1)
    finally:
        kill_tree([proc])
    out = (tmp_path / "node.log").read_text()
    assert "rank 0: ending this process: rank 1 sent no heartbeat for" in out
