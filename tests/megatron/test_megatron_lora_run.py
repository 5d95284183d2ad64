"""A whole LoRA GRPO run on the megatron backend at TP=2 under torchrun (model.lora rank 4 on the seven
projections, a LoRA SFT warm start of 2 steps, so the reference is the warm-started adapters): the
run writes its PEFT adapter folder where the torch backend does, its checkpoints hold the adapters
(and the reference's), and a run stopped after step 2 and resumed writes the same metrics and the
same step-3 adapters, bit for bit, as an uninterrupted 3-step run."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from mt_helpers import ROOT, _shared
from run_helpers import lines, stable

ARGS = ["--config", "configs/demo_cpu.yaml", "--sft.max_steps", "2", "--sft.batch_size", "8", "--rollout.batch_size", "4",
        "--grpo.n_samples", "4", "--rollout.max_new_tokens", "16", "--trainer.backend", "megatron",
        "--trainer.tensor_parallel", "2", "--model.lora.rank", "4", "--trainer.lr", "1e-2",
        "--checkpoint.interval", "1", "--metrics.progress", "false", "--metrics.tensorboard", "false",
        "--deterministic", "true", "--rewards.functions", "[{name: 'algo_helpers:length_reward'}]"]


def launch(out: str, name: str, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.path.join(ROOT, "tests", "algorithms"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_shared().free_port()), "launchers/grpo.py", *ARGS, "--output_dir", out, "--run_name", name,
           *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return lines(os.path.join(out, name, "metrics.jsonl"))


@pytest.mark.slow  # two 2-rank runs, ~70 s on two cores
def test_megatron_lora_run_writes_the_adapter_folder_and_resumes_exactly(tmp_path):
    from safetensors.torch import load_file

    out = str(tmp_path)
    ref = launch(out, "r", "--max_steps", "3")
    assert [r["step"] for r in ref] == [1, 2, 3]
    run = os.path.join(out, "r")
    folder = os.path.join(run, "adapter", "step_3")
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(folder, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4
    with open(os.path.join(run, "checkpoints", "step_000002", "trainer", "megaforge_trainer.json")) as f:
        meta = json.load(f)
    assert meta["lora"]["reference"] == "adapters"  # the LoRA SFT warm start's adapters
    want = load_file(os.path.join(folder, "adapter_model.safetensors"))
    # stopped after step 2 (its newest checkpoint), resumed: the same step 3
    shutil.rmtree(os.path.join(run, "checkpoints", "step_000003"))
    shutil.rmtree(folder)
    resumed = launch(out, "r", "--max_steps", "3", "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert stable(resumed) == stable(ref)
    got = load_file(os.path.join(folder, "adapter_model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
