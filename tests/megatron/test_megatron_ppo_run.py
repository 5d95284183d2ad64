"""A whole PPO run (algo.advantage gae: policy + critic) on the megatron backend at TP=2 under
torchrun: critic metrics are logged, the checkpoint holds the critic, and a run stopped after step 2
and resumed writes the same metrics as an uninterrupted 3-step run."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from mt_helpers import ROOT, _shared
from run_helpers import lines, stable

ARGS = ["--config", "configs/demo_cpu.yaml", "--sft.max_steps", "2", "--rollout.batch_size", "4",
        "--grpo.n_samples", "4", "--rollout.max_new_tokens", "16", "--trainer.backend", "megatron",
        "--trainer.tensor_parallel", "2", "--algo.advantage", "gae", "--algo.kl_in_reward", "true",
        "--trainer.mini_batches", "2", "--checkpoint.interval", "1", "--metrics.progress", "false",
        "--metrics.tensorboard", "false", "--deterministic", "true",
        "--rewards.functions", "[{name: 'algo_helpers:length_reward'}]"]


def launch(out: str, name: str, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.path.join(ROOT, "tests", "algorithms"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_shared().free_port()), "launchers/grpo.py", *ARGS, "--output_dir", out, "--run_name", name, *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return lines(os.path.join(out, name, "metrics.jsonl"))


@pytest.mark.slow
def test_ppo_run_with_megatron_critic_resumes_exactly(tmp_path):
    out = str(tmp_path)
    ref = launch(out, "ref", "--max_steps", "3")
    assert [r["step"] for r in ref] == [1, 2, 3]
    assert all(r["critic/loss"] > 0 and r["critic/grad_norm"] > 0 for r in ref)
    assert ref[1]["critic/values"] != 0.0  # the value head learned in step 1
    ckpts = os.path.join(out, "ref", "checkpoints")
    with open(os.path.join(ckpts, "step_000002", "trainer", "megaforge_trainer.json")) as f:
        meta = json.load(f)
    assert meta["critic"] and meta["critic_steps"] == 4  # 2 steps x 2 mini-batches
    # the run as if stopped after step 2 (its newest checkpoint), resumed: the same step 3 (one launch
    # fewer than running a separate 2-step run; the metrics file is cut back to the checkpoint's step)
    shutil.rmtree(os.path.join(ckpts, "step_000003"))
    resumed = launch(out, "ref", "--max_steps", "3", "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert stable(resumed) == stable(ref)
