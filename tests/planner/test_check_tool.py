"""tools/bench/check_memory_estimate.py: the CPU smoke run goes through the whole GPU code path (Megatron
trainer from a config JSON with random weights, embedded-engine rollout, RL train step, the
planner's prediction) and prints one JSON line; measured values are null on CPU."""
import os
import sys

import pytest
import torch
from planner_helpers import ROOT, last_json, run


def test_cpu_smoke_prints_prediction_beside_measurement():
    pytest.importorskip("megatron.core")
    proc = run(["tools/bench/check_memory_estimate.py", "--cpu_smoke", "--beta", "0.1"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["tool"] == "check_memory_estimate" and out["device"] == "cpu"
    assert set(out["phases"]) == {"rollout", "train"}
    for ph in out["phases"].values():
        assert ph["measured_gib"] is None and ph["rel_error"] is None
        assert ph["predicted_gib"] > 0
    # the prediction is the planner's for the same config, not a number of the tool's own
    from megaforge.build import RunBuilder
    from megaforge.planner import make_plan
    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))  # the benchmark imports tools/common.py itself
    from check_memory_estimate import build_config, parse_args

    cfg = build_config(parse_args(["--cpu_smoke", "--beta", "0.1"]), "cpu")
    plan = make_plan(RunBuilder(cfg).plan_input(), "grpo", {"nodes": 1, "gpus_per_node": 1, "gpu": "cpu", "gpu_memory_gib": 80.0})
    assert out["phases"]["train"]["predicted_gib"] == round(plan["phases"]["train"]["trainer_allocated_gib"], 3)
    assert out["phases"]["rollout"]["predicted_gib"] == round(plan["phases"]["rollout"]["allocated_gib"], 3)
    assert "reference model" in out["phases"]["train"]["predicted_items_gib"]  # beta > 0
    assert out["train_loss"] is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_cuda_it_refuses_and_points_to_the_smoke_mode():
    proc = run(["tools/bench/check_memory_estimate.py"])
    assert proc.returncode == 2 and "--cpu_smoke" in proc.stderr


def test_cpu_smoke_of_a_lora_policy_reports_the_adapters_and_the_sglang_colocated_plan():
    # issue 43 point 4: the planner's estimate for a LoRA policy (on the GPU: the 7B shape) beside its measured step
    pytest.importorskip("megatron.core")
    proc = run(["tools/bench/check_memory_estimate.py", "--cpu_smoke", "--lora_rank", "4", "--no_rollout"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    assert out["layout"]["lora"]["rank"] == 4 and set(out["phases"]) == {"train"}
    items = out["phases"]["train"]["predicted_items_gib"]
    assert "LoRA adapters optimizer (Adam)" in items and "trainer weights" in items
    assert {"rollout", "train", "sync"} <= set(out["sglang_colocated_plan"])
    assert all(v["verdict"] == "fits" for v in out["sglang_colocated_plan"].values())
