"""Layouts that cannot work fail the dry run with the config key and the broken constraint; the
launcher exits non-zero without a traceback. Placement follows megatron's rank order."""
import os

import pytest
from planner_helpers import GSM8K, GSPO, MODELS, ROOT, last_json, plan, run

QWEN3 = os.path.join(MODELS, "qwen3-1.7b")  # 28 layers, 16 heads, 8 kv heads
MOE = os.path.join(MODELS, "qwen3-30b-a3b")  # 48 layers, 32 heads, 4 kv heads, 128 experts
H100x8 = dict(model_config=QWEN3, gpus_per_node=8, gpu="H100")


def messages(p: dict) -> list[str]:
    return [e["message"] for e in p["errors"]]


def test_the_recipe_layout_passes():
    p = plan(GSM8K, **H100x8)
    assert p["exit_code"] == 0 and not p["errors"], p["errors"]


@pytest.mark.parametrize("overrides,opts,expected", [
    # TP not dividing the heads (and the kv heads)
    (["--trainer.tensor_parallel", "3"], dict(gpus_per_node=6),
     "trainer.tensor_parallel=3 does not divide num_attention_heads=16"),
    (["--trainer.tensor_parallel", "16"], dict(gpus_per_node=16),
     "trainer.tensor_parallel=16 does not divide num_key_value_heads=8"),
    # PP not dividing the layers
    (["--trainer.pipeline_parallel", "3"], dict(gpus_per_node=6),
     "trainer.pipeline_parallel=3 does not divide num_hidden_layers=28"),
    # EP on a dense model
    (["--trainer.expert_parallel", "2"], {}, "trainer.expert_parallel=2 needs a mixture-of-experts model"),
    # more GPUs asked than exist: a model replica, the engines, the rollout GPUs
    (["--trainer.tensor_parallel", "8"], dict(gpus_per_node=4),
     "trainer.tensor_parallel x pipeline_parallel x context_parallel = 8 x 1 x 1 = 8 needs more GPUs than the 4 trainer GPUs"),
    (["--rollout.num_engines", "16"], {}, "rollout.num_engines x rollout.tensor_parallel = 16 x 1 = 16 GPUs > the 8 GPUs of the job"),
    (["--rollout.num_gpus", "8"], {}, "rollout.num_gpus=8 leaves no GPU for the trainer"),
    (["--rollout.num_gpus", "2"], {},  # 6 trainer GPUs, 8 engines want 8 rollout GPUs
     "rollout.num_engines x rollout.tensor_parallel = 8 x 1 = 8 GPUs > the 2 rollout GPUs"),
    # CP not dividing the GPUs, CP on the torch backend
    (["--trainer.context_parallel", "3"], {}, "= 1 x 1 x 3 = 3 does not divide the 8 trainer GPUs"),
    (["--trainer.backend", "torch", "--trainer.context_parallel", "2"], {},
     "trainer.context_parallel=2 needs trainer.backend megatron"),
    # engine TP against the model and the node
    (["--rollout.tensor_parallel", "3", "--rollout.num_engines", "2"], {}, "rollout.tensor_parallel=3 does not divide num_attention_heads=16"),
    (["--rollout.tensor_parallel", "16", "--rollout.num_engines", "1"], dict(nodes=2),
     "rollout.tensor_parallel=16 exceeds gpus_per_node=8"),
    # a batch too small for the data-parallel ranks
    (["--rollout.batch_size", "1", "--grpo.n_samples", "4"], {}, "rollout.batch_size: a mini-batch of 1 sequences cannot feed 8 data-parallel ranks"),
])
def test_impossible_layouts_name_the_constraint(overrides, opts, expected):
    p = plan(GSM8K, *overrides, **{**H100x8, **opts})
    assert p["exit_code"] == 1 and not p["ok"]
    assert any(expected in m for m in messages(p)), messages(p)
    assert "placement" not in p and "phases" not in p


@pytest.mark.parametrize("overrides,expected", [
    (["--trainer.expert_parallel", "3"], "trainer.expert_parallel=3 does not divide num_experts=128"),
    (["--trainer.tensor_parallel", "8", "--trainer.pipeline_parallel", "1"], "trainer.tensor_parallel=8 does not divide num_key_value_heads=4"),
    (["--trainer.expert_parallel", "16"], "(CP x DP) % EP == 0, here CP x DP = 8"),  # 32 GPUs / (TP 2 x PP 2)
    (["--rollout.tensor_parallel", "6", "--rollout.num_engines", "4"], "rollout.tensor_parallel=6 neither divides nor is a multiple of num_key_value_heads=4"),
    (["--trainer.layer_spec", "torch", "--trainer.moe_experts", "grouped"], "trainer.moe_experts=grouped needs trainer.layer_spec te"),
    (["--trainer.layer_spec", "torch", "--model.lora.rank", "8"],
     "model.lora.target_modules: ['gate_proj', 'up_proj', 'down_proj'] would target the mixture-of-experts layers' experts"),
])
def test_impossible_moe_layouts(overrides, expected):
    p = plan(GSPO, *overrides, model_config=MOE, nodes=4, gpus_per_node=8, gpu="H100")
    assert p["exit_code"] == 1
    assert any(expected in m for m in messages(p)), messages(p)


def test_moe_recipe_plan_and_expert_coordinates():
    p = plan(GSPO, model_config=MOE, nodes=4, gpus_per_node=8, gpu="H100")
    assert p["exit_code"] == 0, p["errors"]
    lay = p["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["ep"], lay["edp"]) == (2, 2, 8, 8, 1)
    assert not any("no family for it yet" in w for w in p["warnings"])  # qwen3_moe has a megatron family
    rows = [r["trainer"] for r in p["placement"]]
    # megatron order tp-cp-ep-dp-pp: rank = tp + TP*(cp + CP*(dp + DP*pp)); experts tp-ep-dp-pp
    for r in rows:
        assert r["rank"] == r["tp"] + 2 * (r["cp"] + 1 * (r["dp"] + 8 * r["pp"]))
        assert r["ep"] == (r["rank"] // 2) % 8
    assert [r["pp"] for r in rows] == [0] * 16 + [1] * 16
    engines = [(r["node"], r["gpu"], r["engine"]["id"]) for r in p["placement"]]
    assert {(n, g) for n, g, e in engines if e == 5} == {(2, 4), (2, 5), (2, 6), (2, 7)}  # engine 5: TP 4 on node 2


def test_disaggregated_placement():
    p = plan(GSM8K, "--rollout.num_gpus", "4", "--rollout.num_engines", "4", **{**H100x8, "nodes": 2})
    assert p["exit_code"] == 0, p["errors"]
    lay = p["layout"]
    assert lay["world"] == 12 and lay["dp"] == 12 and not lay["colocated"]
    for r in p["placement"]:  # each node: 6 trainer GPUs, then 2 engine GPUs
        assert ("trainer" in r) == (r["gpu"] < 6) and ("engine" in r) == (r["gpu"] >= 6)
    assert set(p["phases"]) == {"rollout", "train"}
    assert p["phases"]["rollout"]["trainer_allocated_gib"] == 0  # nothing of the trainer on engine GPUs
    assert p["phases"]["train"]["engine_allocated_gib"] == 0


def test_context_parallel_pads_odd_sequences():
    """Odd sequence lengths are not an error under CP: megaforge's packing pads every row to a
    multiple of 2 x CP (megaforge/trainer/megatron/packing.py); the plan says so and counts it."""
    p = plan(GSM8K, "--trainer.context_parallel", "2", "--rollout.max_new_tokens", "3583", **H100x8)
    assert p["exit_code"] == 0
    assert any("padded to multiples of 2 x context_parallel = 4" in w for w in p["warnings"])
    assert p["micro_batch"]["seq_len"] == 4095
    assert p["micro_batch"]["tokens_per_rank"] == p["micro_batch"]["rows"] * 4096 // 2  # padded, then split over CP


def test_launcher_exits_nonzero_naming_the_constraint(tmp_path):
    proc = run(["launchers/grpo.py", "--config", GSM8K, "--dry_run", "--model_config", QWEN3, "--gpus_per_node", "8",
                "--trainer.pipeline_parallel", "3", "--output_dir", str(tmp_path / "runs")])
    assert proc.returncode == 1
    assert "trainer.pipeline_parallel=3 does not divide num_hidden_layers=28" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert last_json(proc.stdout)["exit_code"] == 1
    assert not os.path.exists(tmp_path / "runs")


def test_flags_need_dry_run_and_missing_model_config_is_named():
    proc = run(["launchers/grpo.py", "--config", GSM8K, "--nodes", "2"])
    assert proc.returncode == 2 and "--nodes only applies to a dry run" in proc.stderr
    proc = run(["launchers/grpo.py", "--config", GSM8K, "--dry_run", "--gpus_per_node", "8"])
    assert proc.returncode == 1
    assert "cannot read the model's HF config offline" in proc.stderr and "--model_config" in proc.stderr
    proc = run(["launchers/sft.py", "--config", "configs/sft_llama3.1_8b.yaml", "--dry_run",
                "--model_config", os.path.join(ROOT, "configs", "models", "nope")])
    assert proc.returncode == 1 and "--model_config" in proc.stderr and "no config.json there" in proc.stderr


def test_model_type_without_a_megatron_family_is_planned_with_a_warning(tmp_path):
    """A known architecture the megatron backend cannot build yet (mistral): the plan is made and
    says plainly that the run cannot start today."""
    import json

    with open(os.path.join(MODELS, "llama-3.1-8b", "config.json")) as f:
        c = json.load(f)
    c["model_type"], c["architectures"] = "mistral", ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    p = plan(GSM8K, model_config=str(tmp_path), nodes=1, gpus_per_node=8, gpu="H100")
    assert any("model_type mistral: megaforge's megatron backend has no family for it yet" in w for w in p["warnings"])

