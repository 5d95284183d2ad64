"""The torch trainer's attention on CUDA: no forward whose backward runs uses cuDNN's SDPA, whose
bfloat16 backward returns NaN in dQ for masked sequences of length 64 mod 128 when a row's logsumexp
is below ln(FLT_MAX) (pytorch/pytorch#196678): CUDA only.

    python -m pytest -q tests/gpu/test_trainer_cuda.py
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from megaforge.build import RunBuilder
from megaforge.trainer import precision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nan_inputs(L: int = 704, D: int = 64):
    """q, k, v [1, 1, L, D] bfloat16 and a causal boolean mask whose every score is about -120 (each
    row's logsumexp < -88.7): the shape of the failing Qwen2.5 head of the issue above."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    k = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    v = torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)
    mask = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()[None, None]
    return [t.requires_grad_() for t in (q, k, v)], mask


def test_training_attention_keeps_the_masked_backward_finite():
    (q, k, v), mask = nan_inputs()
    with precision.training_attention(torch.device("cuda")):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert "Cudnn" not in type(out.grad_fn).__name__, type(out.grad_fn).__name__
    out.backward(torch.ones_like(out))
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def test_the_trainers_attention_calls_exclude_cudnn(monkeypatch):
    from megaforge.config import load_config
    from megaforge.trainer.torch_backend import TorchTrainer
    from megaforge.types import TrainBatch

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg = load_config(["--config", f"{ROOT}/configs/demo_cpu.yaml", "--model.config", f"{ROOT}/configs/models/tiny-qwen2",
                       "--model.tokenizer", f"{ROOT}/assets/tiny-tokenizer", "--trainer.device", "cuda",
                       "--trainer.micro_batch_size", "4", "--trainer.autocast", "bfloat16"])
    trainer = TorchTrainer(RunBuilder(cfg).trainer_spec(), None)
    T = 192  # 64 mod 128, the failing lengths
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(8, T)
    mask[:, 8:] = 1
    batch = TrainBatch(tokens=torch.randint(3, 500, (8, T), generator=g), lengths=torch.full((8,), T), loss_mask=mask,
                       advantages=torch.randn(8, T, generator=g) * mask, rollout_logprobs=torch.zeros(8, T))
    batch.num_tokens, batch.num_seqs = int(mask.sum()), 8
    trainer.compute_logprobs(batch)
    m = trainer.train_step(batch)
    assert seen and not any(seen), seen  # SDPA ran, never with cuDNN's backend enabled
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the forwards
    assert math.isfinite(m["loss"]) and m["skipped"] == 0
