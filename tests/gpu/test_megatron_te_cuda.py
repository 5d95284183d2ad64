"""The Megatron trainer's Transformer Engine layer spec on CUDA, in bfloat16 and with FP8 (hybrid,
delayed scaling), on a 4-layer Qwen3 (q/k norms, head_dim 24, vocabulary 250 padded by megatron) and, in
bfloat16, a 4-layer Qwen3-MoE with grouped-GEMM experts:
what the main path's TE + FP8 recipe relies on, checked on a model small enough to compare exactly.

* HF weights in -> TE's fused names (norms inside linear_qkv / linear_fc1) -> HF weights out:
  bit-equal to the checkpoint cast to bfloat16 (the converter only renames and splits).
* logprobs against the float32 HF model: as close as the torch spec's in bfloat16 (<= 3x its mean
  error: the fused TE kernels round differently, no more), and with FP8 further than that (FP8 is
  really applied: e4m3 keeps 3 mantissa bits, bfloat16 7) yet < half the logprobs' own spread over
  tokens (a mis-mapped weight moves them by about that spread); FP8 measured at the second forward,
  whose delayed scales come from the first's amax (the first quantizes with scale 1).
* two RL steps move the weights; save -> a new trainer -> load gives the same weights bit for bit and
  the same logprobs (bfloat16: equal; FP8: the amax history advanced by one forward since, so within
  a tenth of the spread); one more step and export_hf reload in transformers as the same tensors.
* FP8 delayed scaling's checkpointed state is a pickle: loading it is refused (UntrustedCheckpointState
  naming checkpoint.trust_te_pickle) until the config trusts it.

Skipped without CUDA (conftest) or without transformer_engine.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
from mt_helpers import hf_logprobs, make_batch, make_tiny, run_workers  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                                reason="needs transformer_engine (tools/gpu/te_build.sh)")


def _masked_mean_abs(x, mask):
    return float((x.abs() * mask).sum() / mask.sum())


def disk_tensors(path: str) -> dict:
    """Every tensor of an HF folder's safetensors files as stored (transformers 5 fuses a Qwen3-MoE's
    per-expert tensors into one [E, ...] tensor when it loads them; on disk, and in megaforge's
    export and weight sync, each expert has its own)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def make_tiny_moe(path: str) -> str:
    """A 4-layer random Qwen3-MoE (8 experts, top-2, renormalised; layer 0 dense), vocabulary 250,
    head_dim 24, expert FFN 32: every dimension a multiple of 16 (TE's grouped GEMM wants aligned
    shapes). Norms perturbed so they matter, as make_tiny."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind,fp8", [("qwen3", None), ("qwen3", "hybrid"), ("qwen3_moe", None)])
def test_te_spec_weights_logprobs_steps_and_checkpoint(tmp_path, kind, fp8):
    """Also the MoE path of the TE spec: experts as one grouped GEMM (TEGroupedMLP over TE's
    GroupedLinear, fused permute), whose weights map to the HF experts bit for bit, beside the same
    TE spec with SequentialMLP experts: the two forwards agree to bf16 rounding."""
    import transformers

    moe = kind == "qwen3_moe"
    model = make_tiny_moe(str(tmp_path / kind)) if moe else make_tiny(kind, str(tmp_path / kind))
    spec = {"model": model, "fp8": fp8, "ckpt": str(tmp_path / "ckpt"), "export": str(tmp_path / "export"),
            "moe_sequential": moe}
    res = run_workers("te_cuda", 1, spec, tmp_path / "work", timeout=420)[0]
    assert res["spec"] == "te"
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in res["names"]), res["names"][:8]
    if moe:  # grouped experts: linear_fcN.weight{k}, one GroupedLinear per projection; none per expert
        assert "decoder.layers.1.mlp.experts.linear_fc1.weight7" in res["names"], res["names"]
        assert not any("local_experts" in n for n in res["names"])
        assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in res["seq_names"]

    hf = disk_tensors(model) if moe else transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    assert sorted(res["w0"]) == sorted(hf)
    for k, v in hf.items():
        assert torch.equal(res["w0"][k], v.to(torch.bfloat16)), k

    batch = make_batch(B=5, T=40, lengths=(40, 17, 33, 9, 27))
    mask = (torch.arange(40)[None] < batch.lengths[:, None]).float()
    mask[:, 0] = 0  # no logprob at t = 0
    ref = hf_logprobs(model, batch, temperature=0.8)
    centre = (ref * mask).sum() / mask.sum()
    spread = _masked_mean_abs(ref - centre, mask)
    err_torch = _masked_mean_abs(res["torch_lp0"] - ref, mask)
    err = _masked_mean_abs(res["lp0"] - ref, mask)
    err_first = _masked_mean_abs(res["lp0_first"] - ref, mask)
    print(f"fp8={fp8}: mean |logprob - HF fp32|: te {err:.3e} (first forward {err_first:.3e}), "
          f"torch spec bf16 {err_torch:.3e}; spread {spread:.3e}")
    assert spread > 0.01, "the test model's logprobs barely vary: the comparison would not discriminate"
    if moe:
        err_seq = _masked_mean_abs(res["seq_lp0"] - ref, mask)
        gap = _masked_mean_abs(res["lp0"] - res["seq_lp0"], mask)
        print(f"MoE: grouped vs sequential experts (TE spec) mean |diff| {gap:.3e}, sequential vs HF {err_seq:.3e}")
        assert gap <= err_seq + 1e-5  # same weights and routing: the kernels' rounding, no more than bf16's own
    if fp8 is None:
        assert err <= 3 * err_torch + 1e-5
    else:
        assert 2 * err_torch < err < 0.5 * spread

    for m in res["metrics"] + res["metrics2"]:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert any(not torch.equal(res["w0"][k], res["w1"][k]) for k in hf), "two RL steps left every weight as it was"

    if fp8:
        assert "checkpoint.trust_te_pickle" in res["untrusted_load"], res["untrusted_load"]
    for k in hf:
        assert torch.equal(res["w1"][k], res["w2"][k]), f"{k} differs after save -> load"
    drift = _masked_mean_abs(res["lp2"] - res["lp1"], mask)
    if fp8 is None:
        assert drift == 0.0
    else:
        assert drift < 0.1 * spread, drift

    exported = (disk_tensors(spec["export"]) if moe else
                transformers.AutoModelForCausalLM.from_pretrained(spec["export"], dtype=torch.bfloat16).state_dict())
    assert sorted(exported) == sorted(hf)
    for k, v in exported.items():
        assert torch.equal(v, res["w3"][k]), k
