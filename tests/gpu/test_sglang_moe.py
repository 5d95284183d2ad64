"""Real SGLang serving a mixture-of-experts policy that the Megatron trainer updates, on one GPU.

A tiny random Qwen3-MoE (bf16, 2 layers, head_dim 128, 8 experts top-2 renormalised, the repo
tokenizer) is served by SGLang (``rollout.engine: sglang``, its own environment) beside a
MegatronTrainer holding the same weights on the same GPU (layer spec auto: TE with grouped-GEMM
experts where Transformer Engine imports, else the torch spec's SequentialMLP). Covered:

* the trainer's expert weights, gathered and converted to Hugging Face's per-expert tensors
  (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, the names SGLang's Qwen3-MoE
  loader maps into its fused ``w13`` / ``w2`` expert tensors) and sent by CUDA IPC, make the served
  logprobs equal the trainer's to bf16 noise;
* after RL steps the engine's old weights are far off (the negative control) and one push brings
  the served logprobs back within bf16 noise;
* release / resume of the KV cache and the weights frees and takes back the device memory.

Figures go to ``$MEGAFORGE_GPU_REPORT`` with a ``moe_`` prefix when it is set.
"""
from __future__ import annotations

import time

import pytest
import torch

from gpu_helpers import TOKENIZER, serving, sglang_rollout
from test_sglang_server import LP_MAX_DIFF, PROMPTS, _batch, _lp_diff, _report, _requests
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    d = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], num_hidden_layers=2, head_dim=128, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
                         eos_token_id=2, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def moe_cfg(moe_dir, tmp_path_factory):
    from megaforge.config import config_from_dict

    return config_from_dict({
        "output_dir": str(tmp_path_factory.mktemp("run")), "run_name": "gpu_moe", "max_steps": 0, "seed": 0,
        "model": {"path": moe_dir, "dtype": "bfloat16"},
        "data": {"path": "arithmetic", "format": "synthetic"},
        "rollout": sglang_rollout(max_restarts=1, health_timeout_s=120.0),
        "sync": {"transport": "ipc"},
        "trainer": {"backend": "megatron", "device": "cuda", "layer_spec": "auto", "lr": 3e-3,
                    "micro_batch_size": 8, "grad_clip": 1.0},
        "grpo": {"beta": 0.0},
    })


@pytest.fixture(scope="module")
def moe_engine(moe_cfg):
    yield from serving(moe_cfg, _report, "moe_server_start_s")


@pytest.fixture(scope="module")
def moe_trainer(moe_cfg):
    from megaforge.trainer.megatron import MegatronTrainer

    tr = MegatronTrainer(RunBuilder(moe_cfg).trainer_spec())
    yield tr
    tr.close()


def test_moe_expert_weights_by_ipc_make_the_served_logprobs_follow_the_megatron_trainer(moe_engine, moe_trainer):
    from megaforge.sync import push_weights

    names = [n for b in moe_trainer.iter_hf_buckets(64 << 20) for n, _ in b]
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any("gate_up_proj" in n for n in names)  # per-expert HF tensors: SGLang's loader fuses them
    first = push_weights(moe_trainer, moe_engine, 64 << 20, 1)
    comps = moe_engine.generate(_requests())
    assert all(c.weight_version == 1 and 0 < len(c.output_ids) <= 16 for c in comps)
    same = _lp_diff(moe_trainer, comps)
    assert same[1] <= LP_MAX_DIFF, f"served logprobs differ from the trainer's by up to {same[1]:.4f}"

    for k in range(2):  # RL steps on served samples: the engine's weights go stale
        done = moe_engine.generate(_requests(seed=100 + k))
        moe_trainer.train_step(_batch(PROMPTS, done))
    stale = _lp_diff(moe_trainer, moe_engine.generate(_requests(seed=7)))
    t = time.perf_counter()
    stats = push_weights(moe_trainer, moe_engine, 64 << 20, 2)
    push_s = time.perf_counter() - t
    after = _lp_diff(moe_trainer, moe_engine.generate(_requests(seed=7)))
    _report("moe_logprobs_vs_megatron_trainer", {
        "layer_spec": moe_trainer.spec, "grouped_experts": moe_trainer.bm.grouped_experts, "tensors": stats["tensors"],
        "bytes": stats["bytes"], "push_s": push_s, "same_weights_mean_max": same, "stale_mean_max": stale,
        "after_update_mean_max": after, "first_sync": first})
    assert after[1] <= LP_MAX_DIFF < stale[1], (after, stale)


def test_moe_release_and_resume_free_and_take_back_the_memory(moe_engine, moe_trainer):
    from megaforge.sync import push_weights

    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    moe_engine.release_memory(["kv_cache"])
    free_kv = torch.cuda.mem_get_info()[0]
    moe_engine.release_memory(["weights"])
    free_all = torch.cuda.mem_get_info()[0]
    moe_engine.resume_memory(["weights"])
    push_weights(moe_trainer, moe_engine, 64 << 20, 3)
    moe_engine.resume_memory(["kv_cache"])
    free_back = torch.cuda.mem_get_info()[0]
    got = _lp_diff(moe_trainer, moe_engine.generate(_requests(seed=11)))
    gib = 1 << 30
    _report("moe_release_resume", {"freed_kv_cache_gib": (free_kv - free0) / gib, "freed_weights_gib": (free_all - free_kv) / gib,
                                   "taken_back_gib": (free_all - free_back) / gib, "max_abs_after": got[1]})
    assert free_kv - free0 > 5 * gib
    assert free_all >= free_kv
    assert abs((free_all - free_back) - (free_all - free0)) < 1 * gib
    assert got[1] <= LP_MAX_DIFF
