"""launchers/slurm.py through submitit's local executor (the path a SLURM job takes, on this machine):
a job runs the demo to completion; a job sent the preemption signal mid-run checkpoints, requeues
itself and the requeued job resumes to the same final step with no step logged twice. The sbatch
script of every recipe header is built from its flags."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megaforge import slurm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--sft.max_steps", "2", "--rollout.batch_size", "4",
        "--grpo.n_samples", "2", "--rollout.max_new_tokens", "8", "--metrics.progress", "false",
        "--metrics.tensorboard", "false", "--metrics.log_samples", "0"]


def steps(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = []
    yield started
    for job in started:  # never leave a local job behind (the controller and everything under it)
        proc = getattr(job, "_process", None)
        if proc is not None and proc.poll() is None:
            tree = psutil.Process(proc.pid).children(recursive=True)
            for p in [psutil.Process(proc.pid)] + tree:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            proc.wait(timeout=10)


def wait_done(job, timeout_s):
    deadline = time.time() + timeout_s
    while not job.done():
        assert time.time() < deadline, f"job {job.job_id} still running after {timeout_s} s"
        time.sleep(0.2)
    return job.result()


def test_local_job_runs_the_demo_to_completion(tmp_path, env):
    job, _, cfg = slurm.submit(["--cluster", "local", "--nodes", "1", "--gpus_per_node", "1", "--time", "00:20:00",
                                       *TINY, "--max_steps", "3", "--output_dir", str(tmp_path), "--run_name", "ok"])
    env.append(job)
    res = wait_done(job, 150)
    run = tmp_path / "ok"
    assert res["status"] == "finished" and res["run_dir"] == str(run)
    assert steps(run / "metrics.jsonl") == [1, 2, 3]
    assert os.listdir(run / "checkpoints") == ["step_000003"]
    out = (run / "slurm" / f"{job.job_id}_0_log.out").read_text()
    assert "torch.distributed.run --nnodes 1 --node_rank 0 --nproc_per_node 1" in out
    assert "checkpoint written" in out and "torchrun exited with 0" in out  # the ranks' output is in the run dir


@pytest.mark.slow
def test_preempted_job_checkpoints_requeues_and_resumes(tmp_path, env):
    slow = '[{name: "launch_plugins:slow_reward", kwargs: {delay_s: 0.3}}]'
    job, _, _ = slurm.submit(["--cluster", "local", "--nodes", "1", "--gpus_per_node", "1", "--time", "00:20:00",
                                     *TINY, "--max_steps", "4", "--rewards.functions", slow,
                                     "--output_dir", str(tmp_path), "--run_name", "pre"])
    env.append(job)
    run = tmp_path / "pre"
    deadline = time.time() + 120
    while not steps(run / "metrics.jsonl"):
        assert time.time() < deadline and not job.done(), "the job logged no RL step"
        time.sleep(0.05)
    # exactly what the local controller does at the time limit (and SLURM with --signal=USR2@...):
    # the preemption signal to the task, whose submitit handler calls TrainJob.checkpoint
    task = psutil.Process(job._process.pid).children()
    assert len(task) == 1
    os.kill(task[0].pid, signal.SIGUSR2)
    res = wait_done(job, 150)
    assert res["status"] == "finished"
    assert steps(run / "metrics.jsonl") == [1, 2, 3, 4]  # the same final step, none twice
    out = (run / "slurm" / f"{job.job_id}_0_log.out").read_text()
    err = (run / "slurm" / f"{job.job_id}_0_log.err").read_text()
    assert "SIGUSR1 received: stopped after RL step" in err  # the loop's graceful stop, with a checkpoint
    assert "Caught signal SIGUSR2" in err and "Requeued job" in out  # submitit's handler requeued it
    stopped_at = int(err.split("stopped after RL step ")[1].split()[0])
    assert 1 <= stopped_at < 4
    assert f"resumed from {run}/checkpoints/step_{stopped_at:06d}" in out
    runs = [ln for ln in out.splitlines() if "torch.distributed.run" in ln]
    assert len(runs) == 2 and not runs[0].endswith("--resume") and runs[1].endswith("--resume")  # the requeued job
    assert (run / "slurm" / f"started_{job.job_id}").read_text().count("start") == 2
    assert sorted(os.listdir(run / "checkpoints"))[-1] == "step_000004"


RECIPES = ["grpo_gsm8k_qwen3_1.7b.yaml", "gspo_qwen3_30b_a3b.yaml", "sft_llama3.1_8b.yaml", "dapo_math_qwen2.5_7b.yaml"]


def header_commands(recipe):
    lines = [ln[1:].strip() for ln in open(os.path.join(ROOT, "configs", recipe)) if ln.startswith("#")]
    return [ln.split() for ln in lines if ln.startswith("python launchers/slurm.py")]


def print_sbatch_here(cmd, monkeypatch, capsys):
    """``python launchers/slurm.py ... --print_sbatch`` in this process (megaforge.slurm.main, what the
    launcher runs), from the repo root: its exit code and stdout."""
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    rc = slurm.main([*cmd[2:], "--print_sbatch"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_the_launcher_script_prints_the_sbatch_script(monkeypatch, capsys):
    """launchers/slurm.py as a process: the sbatch script megaforge.slurm.main prints in this process."""
    cmd = header_commands(RECIPES[0])[0]
    p = subprocess.run([sys.executable, *cmd[1:], "--print_sbatch"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == print_sbatch_here(cmd, monkeypatch, capsys) and "#SBATCH --nodes=1" in p.stdout


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_headers_make_their_sbatch_script(recipe, monkeypatch, capsys):
    cmds = header_commands(recipe)
    assert cmds
    for cmd in cmds:
        text = print_sbatch_here(cmd, monkeypatch, capsys)
        flags = dict(zip(cmd[2::2], cmd[3::2]))
        assert f"#SBATCH --nodes={flags['--nodes']}" in text and f"#SBATCH --gpus-per-node={flags['--gpus_per_node']}" in text
        assert f"#SBATCH --partition={flags['--partition']}" in text and f"#SBATCH --account={flags['--account']}" in text
        assert f"#SBATCH --time={slurm.time_minutes(flags['--time'])}" in text
        assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --signal=USR2@" in text and "#SBATCH --requeue" in text
        assert "/slurm/%j_%t_log.out" in text  # output in <run dir>/slurm/


def test_flags_and_time_limits(tmp_path):
    own, rest = slurm.split_flags(["--nodes", "2", "--time=1-02:00:00", "--launcher", "sft", "--qos", "hi", "--wait", "--x", "1"])
    assert own == {"launcher": "sft", "wait": True}
    assert rest == ["--slurm.nodes", "2", "--slurm.time", '"1-02:00:00"', "--slurm.qos", '"hi"', "--x", "1"]
    assert [slurm.time_minutes(t) for t in ("24:00:00", "00:30:00", "00:30:01", "1-00:00:00", "90", "01:30")] == \
        [1440, 30, 31, 1440, 90, 90]
    with pytest.raises(slurm.LaunchError):
        slurm.time_minutes("tomorrow")
    from megaforge.config import load_config

    cfg = load_config(rest[:6] + ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--slurm.gpus_per_node", "8",
                                  "--rollout.num_gpus", "4", "--slurm.sbatch", "{exclusive: true}", "--slurm.mem_gb", "200"])
    assert slurm.procs_per_node(cfg.slurm, cfg.rollout.num_gpus) == 6  # 8 GPUs per node - 4 rollout GPUs / 2 nodes
    script = slurm.sbatch_script(cfg.slurm, cfg.run_name, str(tmp_path))
    assert "#SBATCH --exclusive" in script and "#SBATCH --mem=200GB" in script and "#SBATCH --qos=hi" in script
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(slurm.LaunchError, match="already holds a run"):
        slurm.submit(["--cluster", "local", *TINY, "--output_dir", str(tmp_path), "--run_name", "held"])
