"""``memory.offload: auto``: the planner keeps the trainer state resident when the phases it shares with the
engine fit, else pinned; the dry run shows the choice; the build step decides it before the trainer is
built, from this GPU's memory and the job's size, and prints why.

Every figure here is the planner's float arithmetic on the repository's model configs (no rounding that
differs between CPUs): the GiB thresholds are far from the totals they separate (85.4 vs 140.4; 55.0 of 79.6)."""
import os
import types

import pytest
from planner_helpers import MODELS, ROOT, last_json, load, plan, run

from megaforge.build import RunBuilder
from megaforge.planner.report import decide_offload

RECIPE = "configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml"
Q05B = os.path.join(MODELS, "qwen2.5-coder-0.5b")


def test_auto_is_resident_where_rollout_and_sync_fit_and_pinned_where_not():
    p = plan(RECIPE, "--memory.offload", "auto", model_config=Q05B, gpu="H200")
    assert p["memory_offload"]["auto"] == "none" and "rollout: 85.4 of 140.4 GiB" in p["memory_offload"]["reason"]
    assert any("(resident: memory.offload none)" in k for k in p["phases"]["rollout"]["items"])  # planned resident
    # 60 GiB with SGLang at 0.8 of it: the resident state (10.6 GiB) would not fit beside the KV cache
    p = plan(RECIPE, "--memory.offload", "auto", "--rollout.mem_fraction", "0.8", model_config=Q05B, gpu_memory_gib=60)
    assert p["memory_offload"]["auto"] == "pinned"
    assert p["memory_offload"]["reason"].startswith("with the trainer state resident the rollout phase would need 63.2 of 60.0")
    assert not any("resident" in k for k in p["phases"]["rollout"]["items"])  # planned with the state offloaded
    assert p["phases"]["rollout"]["verdict"] == "fits"


def test_auto_ignores_the_train_phase_which_holds_the_state_either_way():
    # 40 GiB: the train phase (47.6) does not fit with or without offload; rollout and sync do with the state resident
    p = plan(RECIPE, "--memory.offload", "auto", model_config=Q05B, gpu_memory_gib=40)
    assert p["phases"]["train"]["verdict"] == "does not fit"
    assert p["memory_offload"]["auto"] == "none"


def test_auto_with_engines_on_their_own_gpus_is_resident():
    pin = RunBuilder(load("configs/grpo_gsm8k_qwen3_1.7b.yaml", "--memory.offload", "auto", "--rollout.num_gpus", "4",
                          "--rollout.num_engines", "4")).plan_input()
    mode, why = decide_offload(pin, "grpo", {"model_config": os.path.join(MODELS, "qwen3-1.7b"), "gpus_per_node": 8,
                                              "gpu": "H100", "nodes": 2})
    assert (mode, why) == ("none", "the engines run on GPUs of their own: nothing shares the trainer's GPUs")


def test_auto_without_a_model_shape_is_pinned_and_says_why():
    pin = RunBuilder(load(RECIPE, "--memory.offload", "auto", "--model.path", "/nonexistent/model")).plan_input()
    mode, why = decide_offload(pin, "grpo", {"gpu": "H200"})
    assert mode == "pinned" and why.startswith("the planner could not estimate the run with the trainer state resident (")


def test_dry_run_prints_the_choice():
    r = run(["launchers/grpo.py", "--config", RECIPE, "--dry_run", "--gpu", "H100", "--model_config", Q05B,
             "--memory.offload", "auto"])
    assert r.returncode == 0, r.stderr
    assert "memory    memory.offload auto -> none: the rollout and sync phases fit" in r.stdout
    assert last_json(r.stdout)["memory_offload"]["auto"] == "none"


def test_build_step_decides_on_cpu_and_leaves_other_values():
    cfg = load("configs/demo_cpu.yaml", "--memory.offload", "auto", "--trainer.device", "cpu")
    assert RunBuilder(cfg).resolve_offload() == "the trainer runs on cpu: its state lives in host memory already"
    assert cfg.memory.offload == "none"
    cfg = load("configs/demo_cpu.yaml", "--memory.offload", "pinned")
    assert RunBuilder(cfg).resolve_offload() is None and cfg.memory.offload == "pinned"


def test_build_step_on_cuda_plans_with_this_gpu_and_the_jobs_size(monkeypatch, capsys):
    """The CUDA branch with torch.cuda's two calls answered as an H100 would (no GPU here; the real path runs
    on the GPU machine: tools/gpu/h200_session.sh's recipe with --memory.offload auto)."""
    import torch

    import megaforge.hf

    seen = {}

    def decide(pin, mode, opts):
        seen.update(opts)
        return decide_offload(pin, mode, {**opts, "model_config": Q05B})

    monkeypatch.setattr(megaforge.hf, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(total_memory=85520809984))
    monkeypatch.setattr("megaforge.planner.report.decide_offload", decide)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    cfg = load(RECIPE, "--memory.offload", "auto")
    why = RunBuilder(cfg).resolve_offload()
    assert seen == {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": pytest.approx(79.647, abs=1e-3), "nodes": 2,
                    "gpus_per_node": 8}
    assert cfg.memory.offload == "none" and why.startswith("the rollout and sync phases fit")
    assert f"[megaforge] memory.offload auto -> none: {why}" in capsys.readouterr().err


def test_an_undecided_auto_is_refused_by_the_offloader():
    from megaforge.memory import build_offloader

    with pytest.raises(ValueError, match="'auto' is decided by megaforge.build.RunBuilder.resolve_offload"):
        build_offloader("auto", "cpu", lambda tags: [])
