"""The embedded engine's fast path as it runs on a GPU by default (CUDA graphs, the layer pieces compiled
by inductor, the decode attention chosen by query heads per KV head; fused q/k/v and gate/up weights,
the Gumbel-max sampler), and the torch trainer under bfloat16 autocast: CUDA only (no SGLang needed).

    python -m pytest -q tests/gpu/test_fast_engine_cuda.py
"""
from __future__ import annotations

import pytest
import torch

from megaforge.build import RunBuilder
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
#: bf16 logits of the fused, compiled forward against HF's unfused modules (2 layers, |logit| < ~4, one
#: bf16 ulp there 2^-6 = 0.016): each side rounds its bf16 activations at other points (the GEMM
#: shapes, inductor's fusions), a few ulp; not yet measured on a GPU (the test prints the gap)
FUSED_ATOL = 0.1


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


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_weight_updates_reach_the_compiled_graphs(shape):
    """Updates by name of the LM head and of every fused tensor (q/k/v weights, Qwen2's biases,
    gate/up), then a weights release / resume through the pinned offloader: the replayed graphs read
    the new weights (the fused tensors are the parameters' storage, fast/fuse.py)."""
    model = model_of(shape)
    eng = engine(model)
    reqs = requests(new=16, temperature=0.0)
    before = eng.generate(reqs)
    w = model.get_output_embeddings().weight
    eng.update_weights([[("lm_head.weight", (w.float() * -1.0).to(w.dtype))]], version=1)
    after = eng.generate(reqs)
    assert [o.output_ids for o in after] != [o.output_ids for o in before]
    assert all(o.weight_version == 1 for o in after)
    assert max_logprob_gap(model, reqs, after) <= LP_ATOL  # the replayed graphs read the new weights
    g = torch.Generator(device="cuda").manual_seed(3)
    fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    named = [(n, (t.float() + 0.05 * torch.randn(t.shape, generator=g, device="cuda")).to(t.dtype))
             for n, t in model.state_dict().items() if any(f".{k}." in n for k in fused)]
    eng.update_weights([named], version=2)
    again = eng.generate(reqs)
    assert [o.output_ids for o in again] != [o.output_ids for o in after]
    assert max_logprob_gap(model, reqs, again) <= LP_ATOL
    eng.release_memory(["weights", "cuda_graph"])
    eng.resume_memory(["weights", "cuda_graph"])
    resumed = eng.generate(reqs)
    assert eng.fast.stats["graph_captures"] > 0
    assert max_logprob_gap(model, reqs, resumed) <= LP_ATOL


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_forward_follows_the_hf_modules_in_bfloat16(shape):
    """Prefill and teacher-forced decode logits of the fused forward (one q/k/v GEMM, one gate/up GEMM;
    the layer pieces compiled by inductor, as by default) against the HF forward of unfused copies of
    the same bf16 weights: bf16 activations rounded at other points (2 layers, logits |z| < ~4):
    FUSED_ATOL."""
    import copy

    from megaforge.rollout.embedded.fast.forward import StaticForward

    model = model_of(shape)
    ref = copy.deepcopy(model)
    fwd = StaticForward(model, compile="inductor")
    g = torch.Generator().manual_seed(0)
    U, T, steps = 4, 24, 8
    ids = torch.randint(3, 1024, (U, T + steps), generator=g).cuda()
    with torch.no_grad():
        want = ref(ids).logits[:, T - 1:].float()
    cache = fwd.new_cache(4, 128, "cuda")
    got = [fwd.prefill(cache, ids[:, :T], torch.full((U,), T, device="cuda"), torch.arange(U, device="cuda"))]
    got += [fwd.decode(cache, ids[:, T + s], torch.full((U,), T + s, device="cuda"), 128) for s in range(steps)]
    gap = (torch.stack(got, 1).float() - want).abs().max().item()
    print(f"fused vs HF modules, {shape}, bf16: max |logit gap| {gap:.4f} (|logit| <= {want.abs().max().item():.2f})")
    assert gap <= FUSED_ATOL, gap


def test_sampler_on_cuda_draws_softmax_batch_invariantly():
    """The Gumbel-max draw on the GPU, eager and compiled by inductor (int64 wrap-around and shifts in
    generated code): the same tokens as on the CPU for the same logits and keys (float64 noise: a flip
    needs a top-2 gap below ~1e-13), rows independent of their batch, the chi-square of
    test_sampling.py (false-failure probability 1e-6)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout", "embedded"))
    from test_sampling import LOGITS, chi2_stat, chi2_threshold

    from megaforge.rollout.embedded.sampling import counter_keys, draw_tokens, gumbel_noise, vocab_offsets

    compiled = torch.compile(draw_tokens, backend="inductor", dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    B, V = 64, 151936
    z = 4 * torch.randn(B, V, generator=g)
    keys = counter_keys(torch.randint(0, 2 ** 40, (B,), generator=g), torch.randint(0, 4096, (B,), generator=g))
    off, offc = vocab_offsets(V), vocab_offsets(V, "cuda")
    cpu_tok, cpu_lp = draw_tokens(z, keys, off)
    zc, kc = z.cuda(), keys.cuda()
    # float64 noise: CUDA's and ATen's CPU log differ by <= ~2 ulp (|g| < 45: ~1.4e-14 each)
    assert (gumbel_noise(kc[:4], offc).cpu() - gumbel_noise(keys[:4], off)).abs().max() <= 1e-13
    for fn in (draw_tokens, compiled):
        tok, lp = fn(zc, kc, offc)
        assert torch.equal(tok.cpu(), cpu_tok)
        # float32 log-softmax over 151,936 values, CUDA vs CPU reduction order (|lp| <= ~25)
        assert (lp.cpu() - cpu_lp).abs().max() <= 1e-4
        half = fn(zc[B // 2:], kc[B // 2:], offc)[0]
        assert torch.equal(half, tok[B // 2:])  # batch invariance
    n, T = 100_000, 0.7
    zs = (LOGITS / T).repeat(n, 1).cuda()
    ks = counter_keys(torch.arange(n), torch.full((n,), 3)).cuda()
    for fn in (draw_tokens, compiled):
        tok = fn(zs, ks, vocab_offsets(LOGITS.numel(), "cuda"))[0].cpu()
        assert chi2_stat(tok, torch.softmax(LOGITS.double() / T, -1)) < chi2_threshold(LOGITS.numel() - 1)


def test_torch_trainer_autocast_on_cuda():
    import os

    from megaforge.config import load_config
    from megaforge.trainer.torch_backend import TorchTrainer

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["--config", f"{root}/configs/demo_cpu.yaml", "--model.config", f"{root}/configs/models/tiny-qwen2",
            "--model.tokenizer", f"{root}/assets/tiny-tokenizer", "--trainer.device", "cuda",
            "--trainer.micro_batch_size", "4"]
    off = TorchTrainer(RunBuilder(load_config(base)).trainer_spec(), None)
    on = TorchTrainer(RunBuilder(load_config(base + ["--trainer.autocast", "bfloat16"])).trainer_spec(), None)
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
