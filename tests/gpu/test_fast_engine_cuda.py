"""The embedded engine's fast path as it runs on a GPU by default (CUDA graphs, the layer pieces compiled
by inductor, the decode attention chosen by query heads per KV head), and the torch trainer under bfloat16
autocast: CUDA only (no SGLang needed).

    python -m pytest -q tests/gpu/test_fast_engine_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from megaforge.rollout.embedded import EmbeddedEngine
from megaforge.rollout.embedded.fast.forward import MATMUL_MAX_GROUPS
from megaforge.types import GenerateRequest, SamplingParams

SHAPES = {  # 2 query heads per KV head (auto: matmul) and 7 (auto: sdpa), as Qwen3-1.7B and Qwen2-0.5B
    "qwen3_g2": ("Qwen3", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64)),
    "qwen2_g7": ("Qwen2", dict(hidden_size=448, intermediate_size=512, num_hidden_layers=2, num_attention_heads=7,
                               num_key_value_heads=1)),
}
#: bfloat16 log-probs of the engine's kernels against the HF forward of the same weights: bench_rollout's
#: check measured max 0.037 (0.5B shape) and 0.074 (1.5B) over 8 rows x 256 tokens; 2 layers add less
LP_ATOL = 0.1


def model_of(name: str, device="cuda", dtype=torch.bfloat16):
    import transformers

    family, kw = SHAPES[name]
    cfg = getattr(transformers, f"{family}Config")(vocab_size=1024, max_position_embeddings=512, eos_token_id=None,
                                                   bos_token_id=None, pad_token_id=0, **kw)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(cfg).to(device=device, dtype=dtype).eval()


def requests(n: int = 12, new: int = 24, **sp) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(1)
    lens = [5 + (7 * i) % 40 for i in range(n)]
    return [GenerateRequest(torch.randint(3, 1024, (k,), generator=g).tolist(),
                            SamplingParams(max_new_tokens=new, seed=i, **{"temperature": 1.0, **sp}), f"r{i}")
            for i, k in enumerate(lens)]


def max_logprob_gap(model, reqs, outs) -> float:
    """Largest |engine log-prob - log softmax of the model's own forward| over every sampled token."""
    worst = 0.0
    dev = next(model.parameters()).device
    for r, o in zip(reqs, outs, strict=True):
        seq = torch.tensor([r.input_ids + o.output_ids], device=dev)
        with torch.no_grad():
            logits = model(seq).logits[0, len(r.input_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, seq[0, len(r.input_ids):, None]).squeeze(-1)
        worst = max(worst, float((ref.cpu() - torch.tensor(o.output_logprobs)).abs().max()))
    return worst


def engine(model, compile="inductor", attention="auto", graphs=True) -> EmbeddedEngine:
    return EmbeddedEngine(model, None, max_batch=8, fast="on",
                          fast_options={"compile": compile, "attention": attention, "graphs": graphs})


@pytest.mark.parametrize("attention", ["auto", "sdpa", "matmul"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_compiled_graphed_decode_logprobs_follow_the_model(shape, attention):
    model = model_of(shape)
    eng = engine(model, attention=attention)
    want = attention if attention != "auto" else ("matmul" if eng.fast.fwd.groups <= MATMUL_MAX_GROUPS else "sdpa")
    assert eng.fast.fwd.attention == want and eng.fast.fwd.compiled is not None
    reqs = requests()  # 12 requests through 8 slots: refill and compaction run too
    outs = eng.generate(reqs)
    assert [len(o.output_ids) for o in outs] == [24] * len(reqs)
    st = eng.fast.stats
    assert st["graph_captures"] > 0 and st["graph_failures"] == 0, st
    assert max_logprob_gap(model, reqs, outs) <= LP_ATOL


def test_weight_updates_reach_the_compiled_graphs():
    model = model_of("qwen3_g2")
    eng = engine(model)
    reqs = requests(new=16, temperature=0.0)
    before = eng.generate(reqs)
    w = model.get_output_embeddings().weight
    eng.update_weights([[("lm_head.weight", (w.float() * -1.0).to(w.dtype))]], version=1)
    after = eng.generate(reqs)
    assert [o.output_ids for o in after] != [o.output_ids for o in before]
    assert all(o.weight_version == 1 for o in after)
    assert max_logprob_gap(model, reqs, after) <= LP_ATOL  # the replayed graphs read the new weights


def test_torch_trainer_autocast_on_cuda():
    import os

    from megaforge.config import load_config
    from megaforge.trainer.torch_backend import TorchTrainer

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["--config", f"{root}/configs/demo_cpu.yaml", "--model.config", f"{root}/configs/models/tiny-qwen2",
            "--model.tokenizer", f"{root}/assets/tiny-tokenizer", "--trainer.device", "cuda",
            "--trainer.micro_batch_size", "4"]
    off = TorchTrainer(load_config(base), None)
    on = TorchTrainer(load_config(base + ["--trainer.autocast", "bfloat16"]), None)
    from megaforge.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 500, (8, 48), generator=g)
    mask = torch.zeros(8, 48)
    mask[:, 8:] = 1
    batch = TrainBatch(tokens=tokens, lengths=torch.full((8,), 48), loss_mask=mask,
                       advantages=torch.randn(8, 48, generator=g) * mask, rollout_logprobs=torch.zeros(8, 48))
    batch.num_tokens, batch.num_seqs = int(mask.sum()), 8
    diff = (off.compute_logprobs(batch) - on.compute_logprobs(batch))[mask.bool()].abs().max()
    assert 0 < diff < 0.05, diff  # bfloat16 decoder matmuls, float32 head (CPU: 0.0019 on 15 tokens)
    m = on.train_step(batch)
    assert torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in on.model.parameters())
