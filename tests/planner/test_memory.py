"""The memory estimate: parameter counts equal transformers' own, trainer-state bytes equal hand
computations, per-layer activation bytes follow the stated formula, and the estimate moves the right
way with every knob; the knobs the plan proposes do make the phase fit."""
import json
import os

import pytest
import torch
from planner_helpers import GSM8K, GSPO, MODELS, plan

from megaforge.planner import memory as M
from megaforge.build import RunBuilder
from megaforge.planner.layout import Hardware, check_layout
from megaforge.planner.shapes import shape_from_dict

# Tolerances: the planner is Python float arithmetic (the same on every CPU); its items are reported in
# GiB rounded to 1e-3 (planner/report.py), so a difference of two items is exact to 1e-3: abs 2e-3.
# Parameter counts are compared to the published sizes at their printed precision (0.01 B).
# The H200 check (5%) is the planner's model error against measured peaks, not rounding.

QWEN3 = os.path.join(MODELS, "qwen3-1.7b")
H100x8 = dict(model_config=QWEN3, gpus_per_node=8, gpu="H100")
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256}
MOE_SHARED = {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
              "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2,
              "mlp_only_layers": [3], "vocab_size": 500, "tie_word_embeddings": False}


def hf_numel(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(os.listdir(MODELS)))
def test_parameter_count_equals_transformers(name):
    with open(os.path.join(MODELS, name, "config.json")) as f:
        cfg = json.load(f)
    assert shape_from_dict(cfg).hf_params() == hf_numel(cfg)


@pytest.mark.parametrize("cfg", [TINY, {**TINY, "attention_bias": True}, MOE_SHARED], ids=["llama", "llama_bias", "qwen2_moe"])
def test_parameter_count_of_variants(cfg):
    s = shape_from_dict(cfg)
    assert s.hf_params() == hf_numel(cfg)
    if cfg is MOE_SHARED:
        assert s.moe_layers == [1]  # layers 1 and 3 are sparse by step 2; 3 is an MLP-only layer


def test_published_sizes():
    """The shipped configs have the published parameter counts (in billions)."""
    counts = {n: shape_from_dict(json.load(open(os.path.join(MODELS, n, "config.json")))).hf_params() / 1e9
              for n in ("qwen3-1.7b", "qwen2.5-7b", "qwen3-30b-a3b", "llama-3.1-8b")}
    assert counts["qwen3-1.7b"] == pytest.approx(1.72, abs=0.01)
    assert counts["qwen2.5-7b"] == pytest.approx(7.61, abs=0.01)
    assert counts["qwen3-30b-a3b"] == pytest.approx(30.5, abs=0.05)
    assert counts["llama-3.1-8b"] == pytest.approx(8.03, abs=0.01)


def tiny_layout(tmp_path, *overrides, gpus=4, mode="sft"):
    from megaforge.config import load_config

    d = tmp_path / "tiny"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY))
    cfg = load_config(["--model.config", str(d), "--model.dtype", "bfloat16", "--max_steps", "0",
                       "--trainer.backend", "megatron", *overrides])
    cfg = RunBuilder(cfg).plan_input()  # what the planner reads
    shape = shape_from_dict(TINY)
    lay, errs, _ = check_layout(cfg, shape, Hardware(1, gpus, "x", 80.0), mode)
    assert not errs, errs
    return cfg, shape, lay


def test_trainer_state_bytes_by_hand(tmp_path):
    """TP 2, DP 2, bf16: per layer qkv (64+2*32)*64/2 + o 64*64/2 + MLP 3*64*128/2 + norms 2*64
    = 18560; embedding and output 1024*64/2 each (vocab 1000 padded to 4*256); final norm 64."""
    cfg, shape, lay = tiny_layout(tmp_path, "--trainer.tensor_parallel", "2")
    P = 2 * 18560 + 2 * 32768 + 64
    assert P == 102720
    items = {i.name: i.bytes for i in M.trainer_state(cfg, shape, lay, 0)}
    assert items == {"trainer weights": 2 * P, "gradients (fp32 main grad)": 4 * P, "optimizer (Adam)": 12 * P / 2}
    cfg, shape, lay = tiny_layout(tmp_path, "--trainer.tensor_parallel", "2", "--trainer.distributed_optimizer", "false")
    assert {i.name: i.bytes for i in M.trainer_state(cfg, shape, lay, 0)}["optimizer (Adam)"] == 12 * P
    cfg, shape, lay = tiny_layout(tmp_path, "--trainer.tensor_parallel", "2", "--model.dtype", "float32")
    assert {i.name: i.bytes for i in M.trainer_state(cfg, shape, lay, 0)} == {
        "trainer weights": 4 * P, "gradients (fp32 main grad)": 4 * P, "optimizer (Adam)": 8 * P / 2}


def test_megatron_critic_state_by_hand(tmp_path):
    """PPO (algo.advantage gae) on the megatron backend: a second model of the same layout whose
    output layer (1024*64/2 at TP 2) is a replicated value head (64 weights + 1 bias)."""
    cfg, shape, lay = tiny_layout(tmp_path, "--trainer.tensor_parallel", "2", "--algo.advantage", "gae",
                                  "--max_steps", "1", "--data.path", "x.jsonl", mode="grpo")
    P, C = 102720, 102720 - 32768 + 65
    items = {i.name: i.bytes for i in M.trainer_state(cfg, shape, lay, 0)}
    assert items == {"trainer weights": 2 * P, "gradients (fp32 main grad)": 4 * P, "optimizer (Adam)": 12 * P / 2,
                     "critic weights": 2 * C, "critic gradients (fp32 main grad)": 4 * C,
                     "critic optimizer (Adam)": 12 * C / 2}


def test_torch_backend_state_by_hand(tmp_path):
    cfg, shape, lay = tiny_layout(tmp_path, "--trainer.backend", "torch")
    P = 2 * 1000 * 64 + 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 128 + 3 * 64 * 128)
    assert P == shape.hf_params() == 202048
    items = {i.name: i.bytes for i in M.trainer_state(cfg, shape, lay, 0)}
    assert items == {"trainer weights": 2 * P, "gradients": 2 * P, "DDP gradient buckets": 2 * P, "optimizer (AdamW)": 4 * P}


def test_pipeline_stages_split_embedding_and_output():
    s = shape_from_dict({**TINY, "tie_word_embeddings": True})
    one = s.stage_params(1, 1, 0)
    first, last = s.stage_params(1, 2, 0), s.stage_params(1, 2, 1)
    assert one["output"] == 0 and one["embedding"] == 1024 * 64  # tied: one matrix
    assert first["embedding"] == last["output"] == 1024 * 64  # PP > 1: the last stage keeps a copy
    assert first["output"] == last["embedding"] == 0
    assert first["dense"] + last["dense"] == one["dense"]


def test_layer_activation_bytes_by_hand():
    """h 64, qd 64, kvd 32, F 128, 4 heads, bf16. TE spec (norm bytes n = 2):
    R = 2*2*64 + 2*2*64 = 512; A = 2*(64+64) + 2*(64+32) + 3*2*128 = 1216; out 2*64 = 128; lse 16.
    torch spec (n = 4 + 2 = 6): R = 2*6*64 + 256 = 1024; out 2 copies = 256."""
    s = shape_from_dict(TINY)
    lb = M.layer_bytes
    assert lb(s, 2, "te", 1, False, "none", False) == (1872, 1872)
    assert lb(s, 2, "te", 1, False, "selective", False) == (1856, 1872)
    assert lb(s, 2, "te", 1, False, "full", False) == (128, 1872)
    assert lb(s, 2, "te", 2, True, "none", False) == (936, 936)  # everything / TP with SP
    assert lb(s, 2, "te", 2, False, "none", False) == (1192, 1192)  # norms and linear inputs replicated
    assert lb(s, 2, "torch", 1, False, "none", False) == (2512, 2512)
    assert lb(s, 2, "torch", 1, False, "selective", False)[0] == 2368


def test_loss_buffer_and_micro_batch_tokens(tmp_path):
    cfg, shape, lay = tiny_layout(tmp_path, "--trainer.tensor_parallel", "2", "--trainer.sequence_parallel", "true",
                                  "--trainer.layer_spec", "te", "--trainer.micro_batch_size", "3", "--sft.max_len", "100")
    seq, rows, nm = M.micro_batches(cfg, lay, "sft")
    assert (seq, rows) == (100, 3)
    items = {i.name: i.bytes for i in M.activations(cfg, shape, lay, 0, seq, rows, nm, M.LOSS_BYTES_FWD)}
    s = 300  # tokens of the micro-batch
    assert items["activations (recompute none)"] == s * 2 * 936
    assert items["logits / logprob buffers"] == s * (1024 / 2) * 14 + s * (2 + 2) * 64 / 2


def test_token_budget_plans_whole_rows_within_it(tmp_path):
    """trainer.micro_batch_tokens: full-length rows, ceil(budget / length) of them (never fewer tokens
    than the budget allows), at most micro_batch_size; 0 leaves the row count alone."""
    base = ("--trainer.micro_batch_size", "8", "--sft.max_len", "100")
    for budget, want in (("0", 8), ("250", 3), ("300", 3), ("5000", 8), ("50", 1)):
        cfg, _, lay = tiny_layout(tmp_path, *base, "--trainer.micro_batch_tokens", budget)
        seq, rows, nm = M.micro_batches(cfg, lay, "sft")
        assert (seq, rows) == (100, want), budget


def test_kv_cache_per_token_by_hand():
    p = plan(GSM8K, **H100x8)  # Qwen3-1.7B, SGLang TP 1: 2 (K, V) x 28 layers x 8 kv heads x 128 x 2 B
    assert p["kv"]["kv_bytes_per_token"] == 2 * 28 * 8 * 128 * 2
    mem = 79.6 * 2**30
    weights = 2 * 1720574976
    assert p["kv"]["capacity_tokens"] == int((0.6 * mem - weights) // (2 * 28 * 8 * 128 * 2))
    moe = plan(GSPO, "--rollout.tensor_parallel", "8", "--rollout.num_engines", "4",
               model_config=os.path.join(MODELS, "qwen3-30b-a3b"), nodes=4, gpus_per_node=8, gpu="H100")
    assert moe["exit_code"] == 0  # TP 8 > 4 kv heads: SGLang replicates the KV heads
    assert moe["kv"]["kv_bytes_per_token"] == 2 * 48 * 1 * 128 * 2


def item(p, phase, name):
    return p["phases"][phase]["items"][name]


def test_more_tensor_parallel_means_less_per_gpu():
    prev = None
    for tp in (1, 2, 4):
        p = plan(GSM8K, "--trainer.tensor_parallel", str(tp), "--trainer.sequence_parallel", str(tp > 1).lower(), **H100x8)
        cur = [item(p, "train", k) for k in ("trainer weights", "gradients (fp32 main grad)",
                                             "activations (recompute none)", "logits / logprob buffers")]
        if prev:
            assert all(c < q for c, q in zip(cur, prev)), (tp, cur, prev)
        prev = cur


def test_more_data_parallel_shards_only_the_optimizer():
    one = plan(GSM8K, **H100x8)
    two = plan(GSM8K, **{**H100x8, "nodes": 2})
    assert item(two, "train", "trainer weights") == item(one, "train", "trainer weights")
    assert item(two, "train", "optimizer (Adam)") == pytest.approx(item(one, "train", "optimizer (Adam)") / 2, abs=2e-3)


def test_recompute_and_micro_batch_order_activations():
    act = {}
    for rc in ("none", "selective", "full"):
        p = plan(GSM8K, "--trainer.recompute", rc, **H100x8)
        act[rc] = sum(v for k, v in p["phases"]["train"]["items"].items() if "activations" in k or "recomputed" in k)
    assert act["none"] > act["selective"] > act["full"]
    sizes = [plan(GSM8K, "--trainer.micro_batch_size", str(m), **H100x8)["phases"]["train"]["total_gib"] for m in (1, 2, 4)]
    assert sizes[0] < sizes[1] < sizes[2]


def test_mem_fraction_and_offload_move_the_rollout_phase():
    lo = plan(GSM8K, "--rollout.mem_fraction", "0.5", **H100x8)
    hi = plan(GSM8K, "--rollout.mem_fraction", "0.7", **H100x8)
    assert lo["kv"]["capacity_tokens"] < hi["kv"]["capacity_tokens"]
    assert lo["phases"]["rollout"]["total_gib"] < hi["phases"]["rollout"]["total_gib"]
    resident = plan(GSM8K, "--memory.offload", "none", **H100x8)
    gap = resident["phases"]["rollout"]["trainer_allocated_gib"] - lo["phases"]["rollout"]["trainer_allocated_gib"]
    state = sum(item(lo, "train", k) for k in ("trainer weights", "gradients (fp32 main grad)", "optimizer (Adam)"))
    assert gap == pytest.approx(state, abs=0.01)  # exactly the trainer state stays during rollout


@pytest.mark.parametrize("overrides,phase", [
    (["--trainer.micro_batch_size", "8"], "train"),
    (["--memory.offload", "none", "--rollout.mem_fraction", "0.85"], "rollout"),
    (["--rollout.mem_fraction", "0.04"], "rollout"),  # less than the weights: no KV cache, not one sequence's KV cache
])
def test_proposed_knobs_make_the_phase_fit(overrides, phase):
    p = plan(GSM8K, *overrides, **H100x8)
    assert p["exit_code"] == 3 and p["phases"][phase]["verdict"] == "does not fit"
    knobs = p["phases"][phase]["knobs"]
    assert knobs
    for k in knobs:
        extra = [x for key, v in k["overrides"].items() for x in (f"--{key}", json.dumps(v) if not isinstance(v, str) else v)]
        fixed = plan(GSM8K, *overrides, *extra, **H100x8)
        assert fixed["exit_code"] == 0 and fixed["phases"][phase]["verdict"] == "fits", (k, fixed["phases"][phase])


def test_gpu_memory_sets_the_verdict():
    assert plan(GSM8K, **{**H100x8, "gpu": "H200"})["hardware"]["memory_gib"] == pytest.approx(140.4)
    small = plan(GSM8K, model_config=QWEN3, gpus_per_node=8, gpu_memory_gib=24)
    assert small["exit_code"] == 3 and not small["ok"]


def test_planner_rules_match_the_megatron_backend():
    """The planner keeps torch out of a dry run by restating two rules of the backend: vocabulary
    padding and which model types have a Megatron family. They must not drift."""
    from megaforge.convert import families, layouts
    from megaforge.planner import shapes
    from megaforge.trainer.megatron import model as mmodel

    assert shapes.VOCAB_DIVISIBLE_BY == mmodel.VOCAB_DIVISIBLE_BY
    for v in (1, 127, 128, 1000, 151936, 152064, 128256):
        for tp in (1, 2, 3, 4, 8):
            assert shapes.padded_vocab_size(v, 128, tp) == layouts.padded_vocab_size(v, 128, tp)
    supported = {t for f in families.FAMILIES.values() for t in f.model_types}
    assert {t for t, ok in shapes.KNOWN_TYPES.items() if ok} == supported & set(shapes.KNOWN_TYPES)


def test_entropy_bonus_costs_the_entropy_backward():
    """Op-by-op logprobs (trainer.fused_logprobs false): 14 B per token and vocab column with a
    detached entropy, 26 with an entropy bonus. Fused (null, on a GPU): the bf16 logits and their
    gradient, 4 B, with or without the bonus; + 2 B for the logits / temperature copy."""
    off = ("--trainer.fused_logprobs", "false")
    base = plan(GSM8K, *off, **H100x8)
    bonus = plan(GSM8K, "--algo.entropy_coef", "0.01", *off, **H100x8)
    mb = base["micro_batch"]
    cols = base["model"]["padded_vocab"]
    per_col = mb["tokens_per_rank"] * cols / 2**30
    diff = item(bonus, "train", "logits / logprob buffers") - item(base, "train", "logits / logprob buffers")
    assert diff == pytest.approx(per_col * (26 - 14), abs=2e-3)
    fused = plan(GSM8K, "--grpo.temperature", "1.0", **H100x8)
    fused_bonus = plan(GSM8K, "--grpo.temperature", "1.0", "--algo.entropy_coef", "0.01", **H100x8)
    fused_tau = plan(GSM8K, "--grpo.temperature", "0.7", **H100x8)
    got = [item(p, "train", "logits / logprob buffers") for p in (fused, fused_bonus, fused_tau)]
    assert got[0] == got[1]
    assert got[0] - (item(base, "train", "logits / logprob buffers") - per_col * 14) == pytest.approx(per_col * 4, abs=2e-3)
    assert got[2] - got[0] == pytest.approx(per_col * 2, abs=2e-3)


def test_estimate_against_the_h200_measurements():
    """The planner's phase estimates beside the peaks tools/bench/check_memory_estimate.py measured on an
    H200 (Qwen3-1.7B, TP1 and TP2 + SP; docs/benchmarks/check_memory_estimate_h200.jsonl): within
    5% for the rollout and the train phase. A planner change that moves an estimate away from what
    the GPU measured fails here."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "bench", "check_memory_estimate.py"), "--predict_only",
                          "--measured", os.path.join(root, "docs", "benchmarks", "check_memory_estimate_h200.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["layout"]["tp"], r["layout"]["sp"]) for r in runs] == [(1, False), (2, True)]
    for r in runs:
        for phase in ("rollout", "train"):
            assert abs(r["phases"][phase]["rel_error"]) < 0.05, (r["layout"], phase, r["phases"][phase])


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                    reason="TE's fused Adam has no step temporaries")
def test_optimizer_step_temporary_bounds_the_train_peak():
    """Without TE the foreach Adam's sqrt buffer (4 B per updated param) is a second candidate for
    the peak: train = state + max(activations + loss, 4 * P)."""
    p = plan(GSM8K, "--trainer.recompute", "full", "--rollout.max_new_tokens", "256", "--rollout.num_engines", "1",
             model_config=QWEN3, gpus_per_node=1, gpu="H200")
    items = p["phases"]["train"]["items"]
    work = sum(v for k, v in items.items() if k.startswith(("activations", "one layer", "logits")))
    step = 4 * 1720574976 / 2**30
    assert items["optimizer step temporaries (beyond the activations)"] == pytest.approx(step - work, abs=2e-3)
    big = plan(GSM8K, model_config=QWEN3, gpus_per_node=8, gpu="H200")
    assert not any("temporaries" in k for k in big["phases"]["train"]["items"])  # activations dominate


def test_torch_rl_head_on_trained_positions_only(tmp_path):
    """torch backend, RL step: with trainer.head_positions trained the logits buffer covers at most
    rows x rollout.max_new_tokens positions (14 B per vocab column, detached entropy) plus their
    gathered hidden states (p B x hidden), instead of rows x (max_prompt_len + max_new_tokens)."""
    common = ("--trainer.backend", "torch", "--model.dtype", "float32", "--max_steps", "2", "--data.path", "gsm8k",
              "--data.max_prompt_len", "96", "--rollout.max_new_tokens", "32", "--trainer.micro_batch_size", "4")
    got = {}
    for mode in ("trained", "all"):
        cfg, shape, lay = tiny_layout(tmp_path, *common, "--trainer.head_positions", mode, gpus=1, mode="grpo")
        got[mode] = {i.name: i.bytes for i in M.work_items(cfg, shape, lay, 0, "grpo")}["logits / logprob buffers"]
    seq, rows, _ = M.micro_batches(cfg, lay, "grpo")
    assert (seq, rows) == (128, 4)
    assert got["all"] - got["trained"] == (rows * seq - rows * 32) * 1000 * 14 - rows * 32 * 4 * 64
    sft_cfg, _, sft_lay = tiny_layout(tmp_path, *common, gpus=1)
    assert M.head_positions(sft_cfg, sft_lay, "sft", seq, rows) is None  # SFT: every position


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     ["q_proj", "v_proj"], ["model.layers.0.self_attn.q_proj", "down_proj"]])
def test_lora_adapter_count_equals_peft(targets):
    """ModelShape.lora_params counts what PEFT trains: r * (in + out) per adapted module (exact integers).
    A dotted name is matched by its last part, so it counts every layer's module of that name (the
    planner's upper bound); PEFT adapts only the named one: the difference is stated and checked."""
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY, model_type="qwen2")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    shape = shape_from_dict(cfg)
    want = shape.lora_params(4, targets)
    if any("." in t for t in targets):  # q_proj of layer 1 counted too: 4 * (64 + 64)
        assert want - trained == 4 * (shape.hidden + shape.qd)
    else:
        assert want == trained


def test_lora_plan_counts_adapters_for_gradients_and_adamw_and_no_reference_copy():
    """With model.lora (torch backend): gradients and AdamW hold the adapters alone, weights add them to
    the frozen base, and grpo.beta > 0 adds no reference copy (the base with the adapters off)."""
    base = plan("configs/demo_cpu.yaml", model_config=QWEN3, gpus_per_node=1, gpu="H200")
    lora = plan("configs/demo_cpu.yaml", "--model.lora", "{rank: 16}", model_config=QWEN3, gpus_per_node=1, gpu="H200")
    b, a = base["phases"]["train"]["items"], lora["phases"]["train"]["items"]
    shape = shape_from_dict(json.load(open(os.path.join(QWEN3, "config.json"))))
    na = shape.lora_params(16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert abs(a["LoRA adapters"] - 4 * na / 2**30) < 2e-3 and a["gradients"] == a["LoRA adapters"]
    assert abs(a["optimizer (AdamW)"] - 2 * a["LoRA adapters"]) < 2e-3 < b["optimizer (AdamW)"] / 10
    assert a["trainer weights"] == b["trainer weights"]
    assert "reference model" in b and "reference model" not in a


def test_megatron_lora_plan_counts_the_rank_s_adapters_for_grads_and_adam():
    """trainer.backend megatron with model.lora: the frozen base's weights stay, the fp32 main gradients
    and Adam state are the rank's adapter shards' (M.megatron_lora_params, checked against the trainer's
    parameters in tests/megatron/test_megatron_lora.py), and no reference copy."""
    args = ("configs/demo_cpu.yaml", "--trainer.backend", "megatron", "--trainer.tensor_parallel", "2",
            "--trainer.layer_spec", "torch")
    base = plan(*args, model_config=QWEN3, gpus_per_node=2, gpu="H200")
    lora = plan(*args, "--model.lora", "{rank: 16}", model_config=QWEN3, gpus_per_node=2, gpu="H200")
    b, a = base["phases"]["train"]["items"], lora["phases"]["train"]["items"]
    shape = shape_from_dict(json.load(open(os.path.join(QWEN3, "config.json"))))
    from megaforge.config.model import LoraConfig

    lora_cfg = LoraConfig(rank=16)  # the seven projections
    na = M.megatron_lora_params(shape, lora_cfg, 2, 1, 0)
    assert 0 < na < shape.lora_params(lora_cfg.rank, lora_cfg.target_modules)  # B (column) / A (row) halved at TP 2
    assert abs(a["LoRA adapters gradients (fp32 main grad)"] - 4 * na / 2**30) < 2e-3
    assert a["LoRA adapters optimizer (Adam)"] < b["optimizer (Adam)"] / 10
    assert a["trainer weights"] == b["trainer weights"]
    assert "reference model" in b and "reference model" not in a


def test_cuda_graph_batch_read_from_the_decode_sizes_list():
    """SGLang's --cuda-graph-bs-decode list (the recipes' flags) sets the largest captured batch, as
    --cuda-graph-max-bs does; graphs for 512 rows cost more than for the default 256."""
    from megaforge.config.rollout import server_flags
    from megaforge.planner.memory import SGLANG_DEFAULT_MAX_BS, _graph_max_bs

    def max_bs(args):
        return _graph_max_bs(server_flags(args))
    assert max_bs([]) == SGLANG_DEFAULT_MAX_BS == 256
    assert max_bs(["--cuda-graph-max-bs", "64"]) == 64
    assert max_bs(["--cuda-graph-max-bs=48"]) == 48
    assert max_bs(["--attention-backend", "triton", "--cuda-graph-bs-decode", "1", "2", "512", "320",
                   "--sampling-backend", "pytorch"]) == 512
    assert max_bs(["--cuda-graph-bs", "8", "16"]) == 16
    assert max_bs(["--disable-cuda-graph", "--cuda-graph-bs-decode", "512"]) == 0
