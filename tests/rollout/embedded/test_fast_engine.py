"""The embedded engine's fast path (static KV cache, continuous refill) on CPU, against its oracles:
HF generate, the simple engine, the trainer's forward, one-request-at-a-time runs."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from megaforge.rollout.base import EngineStateError
from megaforge.rollout.embedded import EmbeddedEngine
from megaforge.rollout.embedded.fast import FastDecoder, batch_bucket, kv_bucket, prefill_bucket
from megaforge.rollout.embedded.sampling import process_logits
from megaforge.trainer.logprobs import token_logprobs
from megaforge.types import GenerateRequest, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOKENIZER = os.path.join(ROOT, "assets", "tiny-tokenizer")
FAMILIES = ("llama", "qwen2", "qwen3")


def _save_tiny(path: str, family: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    args = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=family != "llama",
                eos_token_id=2, pad_token_id=0, bos_token_id=None)
    if family == "qwen3":
        args["head_dim"] = 16
    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3}[family])
    AutoModelForCausalLM.from_config(cls(**args), dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for fam in FAMILIES:
        d = _save_tiny(str(tmp_path_factory.mktemp(f"tiny-{fam}")), fam)
        out[fam] = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return out


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1, 7, 3, 19, 40, 11, 2, 25, 9][:n]
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lens]


def _fast(model, tok=None, max_batch=2, chunk=4, **kw) -> EmbeddedEngine:
    eng = EmbeddedEngine(model, tok, max_batch=max_batch, fast="on", fast_options=dict(chunk=chunk, **kw))
    assert isinstance(eng.fast, FastDecoder)
    return eng


def _reqs(prompts, **sp):
    return [GenerateRequest(p, SamplingParams(**sp), f"r{i}") for i, p in enumerate(prompts)]


def _same(a, b, atol=1e-5):
    """Two engines (or batchings) answer the same requests alike. Logprobs: float32 (|lp| <= ~8, ulp
    4.8e-7-9.5e-7) of the same 2-layer model with other padding / cache shapes, so other sum orders:
    measured <= 9.5e-7 on ATen avx512 / avx2 / default and MKL AVX2 kernels; atol 1e-5 (+ rtol 1e-5).
    Tokens: a greedy token flips only at a top-2 logit gap within the logits' rounding (~1e-6), a
    seeded draw (the same counter-based Gumbel noise per request and position in both) only at a
    top-2 gap of logit + noise within it; the smallest margins of these tests' tokens are 1.9e-4
    (greedy gap) and 2.8e-3 (draw gap), measured, so equal tokens are what both must give on any CPU."""
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert x.finish_reason == y.finish_reason
        assert len(x.output_logprobs) == len(x.output_ids)
        assert torch.allclose(torch.tensor(x.output_logprobs), torch.tensor(y.output_logprobs), atol=atol)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate_and_simple_engine(models, family):
    model = models[family]
    prompts = _prompts()
    outs = _fast(model).generate(_reqs(prompts, temperature=0.0, max_new_tokens=12))
    for p, o in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.output_ids == ref[0, len(p):].tolist()
        assert o.finish_reason == "length"
    simple = EmbeddedEngine(model, None, max_batch=8, fast="off")
    _same(outs, simple.generate(_reqs(prompts, temperature=0.0, max_new_tokens=12)))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sp", [dict(temperature=0.7), dict(temperature=1.3, top_k=7), dict(temperature=0.9, top_p=0.8),
                                dict(temperature=1.0, top_k=50, top_p=0.95)])
def test_logprobs_equal_trainer_forward(models, family, sp):
    model = models[family]
    prompts = _prompts()
    outs = _fast(model, max_batch=3).generate(_reqs(prompts, max_new_tokens=10, seed=5, **sp))
    T = sp["temperature"]
    for p, o in zip(prompts, outs):
        seq = torch.tensor([p + o.output_ids])
        with torch.no_grad():
            logits = model(seq).logits
        if "top_k" in sp or "top_p" in sp:  # the truncated, renormalised distribution the sampler used
            n = len(o.output_ids)
            z = process_logits(logits[0, len(p) - 1:-1], torch.full((n,), T), torch.full((n,), sp.get("top_k", -1)),
                               torch.full((n,), sp.get("top_p", 1.0)))
            ref = torch.log_softmax(z, -1).gather(-1, torch.tensor(o.output_ids)[:, None]).squeeze(-1)
        else:
            lp, _ = token_logprobs(logits, seq, torch.tensor([seq.shape[1]]), temperature=T)
            ref = lp[0, len(p):]
        got = torch.tensor(o.output_logprobs)
        assert torch.isfinite(got).all()
        assert (ref - got).abs().max() <= 1e-5, (ref - got).abs().max()  # see _same: measured <= 9.5e-7


@pytest.mark.parametrize("sp", [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)])
def test_seeded_sampling_equals_simple_engine(models, sp):
    model = models["qwen2"]
    prompts = _prompts(6)
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=15, seed=100 + i, **sp)) for i, p in enumerate(prompts)]
    fast = _fast(model, max_batch=4, chunk=3).generate(reqs)
    _same(fast, EmbeddedEngine(model, None, max_batch=8, fast="off").generate(reqs))
    assert len({tuple(o.output_ids) for o in fast}) == len(fast)  # different seeds, different samples


def test_continuous_refill_equals_one_at_a_time(models):
    model = models["qwen3"]
    prompts = _prompts(9, seed=1)
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=[3, 30, 9, 17, 5, 25, 1, 12, 21][i],
                                              seed=i, stop_token_ids=[7, 11] if i % 3 == 0 else []), f"q{i}")
            for i, p in enumerate(prompts)]
    eng = _fast(model, max_batch=3, chunk=4)
    outs = eng.generate(reqs)
    st = eng.fast.stats
    assert st["max_busy"] == 3 and st["prefill_calls"] >= 4  # slots were refilled as rows finished
    alone = _fast(model, max_batch=1, chunk=5)
    simple = EmbeddedEngine(model, None, max_batch=1, fast="off")
    for r, o in zip(reqs, outs):
        assert o.rid == r.rid
        _same([o], alone.generate([r]))
        _same([o], simple.generate([r]))
    assert [len(o.output_ids) for o in outs if o.finish_reason == "length"] == \
        [r.sampling.max_new_tokens for r, o in zip(reqs, outs) if o.finish_reason == "length"]


def test_compaction_moves_the_last_rows_down(models):
    model = models["llama"]
    prompts = _prompts(4, seed=2)
    reqs = _reqs(prompts, temperature=0.0, max_new_tokens=4)
    reqs[3] = GenerateRequest(prompts[3], SamplingParams(temperature=0.0, max_new_tokens=30), "long")
    eng = _fast(model, max_batch=4, chunk=4)
    outs = eng.generate(reqs)
    assert eng.fast.stats["compactions"] >= 1
    _same(outs, EmbeddedEngine(model, None, max_batch=1, fast="off").generate(reqs))


def test_n_samples_share_the_prompt_prefill(models):
    model = models["qwen2"]
    a, b = _prompts(2, seed=3)
    reqs = [GenerateRequest(a, SamplingParams(max_new_tokens=8, seed=s)) for s in range(4)]
    reqs += [GenerateRequest(b, SamplingParams(max_new_tokens=8, seed=s)) for s in range(2)]
    eng = _fast(model, max_batch=8)
    outs = eng.generate(reqs)
    assert eng.fast.stats["prefilled_prompts"] == 2 and eng.fast.stats["shared_prefills"] == 4
    _same(outs, EmbeddedEngine(model, None, max_batch=8, fast="off").generate(reqs))


def test_stop_tokens_strings_and_max_tokens(models, tok):
    model = models["qwen2"]
    p = tok("What is 7 - 3? Think.")["input_ids"]
    fast, simple = _fast(model, tok, chunk=8), EmbeddedEngine(model, tok, fast="off")
    free = fast.generate(_reqs([p], temperature=0.0, max_new_tokens=24))[0]
    stop_tok = free.output_ids[5]
    out = fast.generate(_reqs([p], temperature=0.0, max_new_tokens=24, stop_token_ids=[stop_tok]))[0]
    k = free.output_ids.index(stop_tok)
    assert out.finish_reason == "stop" and out.output_ids == free.output_ids[:k + 1]
    text = tok.decode(free.output_ids, skip_special_tokens=False)
    stop_str = tok.decode(free.output_ids[6:8], skip_special_tokens=False)
    assert stop_str and stop_str in text
    reqs = _reqs([p, p], temperature=0.0, max_new_tokens=24, stop=[stop_str])
    got = fast.generate(reqs)
    assert got[0].finish_reason == "stop" and len(got[0].output_ids) < 24 and stop_str in got[0].text
    _same(got, simple.generate(reqs))
    t0 = fast.progress_time
    one = fast.generate(_reqs([p], temperature=1.0, max_new_tokens=1, seed=0))[0]
    assert len(one.output_ids) == 1 and one.finish_reason == "length"
    assert fast.progress_time > t0  # the server's /health_generate waits for this (a 1-token generate)
    with pytest.raises(ValueError, match="stop strings need"):
        _fast(model).generate(reqs)


def test_abort_finishes_rows_and_waiting_requests(models):
    model = models["qwen2"]
    eng = _fast(model, max_batch=1, chunk=4)
    dec, steps = eng.fast, []
    real_step = dec._step

    def step(*a):
        steps.append(1)
        if len(steps) == 10:
            eng.abort()
        real_step(*a)

    dec._step = step
    outs = eng.generate(_reqs(_prompts(2), temperature=1.0, max_new_tokens=500))
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert len(outs[0].output_ids) == 1 + 12  # the first token, then 3 chunks of 4 (abort seen at a chunk end)
    assert outs[1].output_ids == []  # never admitted
    dec._step = real_step
    again = eng.generate(_reqs(_prompts(1), temperature=1.0, max_new_tokens=5))  # abort is cleared per call
    assert again[0].finish_reason == "length" and len(again[0].output_ids) == 5


def test_memory_release_resume_frees_and_restores_the_cache(models):
    model = models["qwen2"]
    eng = _fast(model, max_batch=4)
    reqs = _reqs(_prompts(4), temperature=0.0, max_new_tokens=6)
    before = eng.generate(reqs)
    shape = (eng.fast.cache.B, eng.fast.cache.L)
    eng.release_memory(["kv_cache", "cuda_graph"])
    assert eng.fast.cache is None and eng.fast.slots is None and not eng.fast.graphs
    with pytest.raises(EngineStateError, match="released"):
        eng.generate(reqs)
    eng.resume_memory(["kv_cache", "cuda_graph"])
    assert (eng.fast.cache.B, eng.fast.cache.L) == shape and not eng.fast.graphs_released
    _same(eng.generate(reqs), before)
    eng.release_memory(["weights"])
    with pytest.raises(EngineStateError, match="released"):
        eng.generate(reqs)
    eng.resume_memory(["weights"])
    _same(eng.generate(reqs), before)


FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the tensors fuse.py fuses


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_weight_updates_by_name_reach_the_fast_path(models, family):
    """Every fused tensor (q/k/v and gate/up weights, Qwen2's q/k/v biases) and others, updated by
    name through update_weights (the path of sync.push and of every server route): the fast path
    answers as the simple loop on the new weights."""
    model = models[family]
    fast, simple = _fast(copy.deepcopy(model), max_batch=4), EmbeddedEngine(copy.deepcopy(model), None, fast="off")
    reqs = _reqs(_prompts(4), temperature=0.0, max_new_tokens=8)
    before = fast.generate(reqs)
    g = torch.Generator().manual_seed(9)
    named = [(n, t + 0.2 * torch.randn(t.shape, generator=g)) for n, t in model.state_dict().items()
             if any(f".{k}." in n for k in FUSED) or n.endswith("norm.weight")]
    assert any(n.endswith("k_proj.bias") for n, _ in named) == (family == "qwen2")
    fast.update_weights([named[: len(named) // 2], named[len(named) // 2:]], version=2)
    simple.update_weights([named], version=2)
    after = fast.generate(reqs)
    assert [o.output_ids for o in after] != [o.output_ids for o in before]
    _same(after, simple.generate(reqs))
    assert all(o.weight_version == 2 for o in after)


def _tiny_qwen2():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(4)
    cfg = AutoConfig.from_pretrained(os.path.join(ROOT, "configs", "models", "tiny-qwen2"))
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["tiny-qwen2", "qwen3"])
def test_fused_forward_equals_the_hf_modules(models, family):
    """Prefill and teacher-forced decode logits of the fused forward (one q/k/v GEMM, one gate/up GEMM)
    against the HF model's own forward on unfused copies of the same weights. float32, 2-4 layers of
    hidden 64-128: measured 4.5e-7 (fused and unfused alike: it is the cache path's sum order, logits
    <= 1.4, ulp 1.2e-7); 1e-5 leaves > 20x for other CPU kernels."""
    from megaforge.rollout.embedded.fast.forward import StaticForward

    model = _tiny_qwen2() if family == "tiny-qwen2" else copy.deepcopy(models[family])
    ref = copy.deepcopy(model)
    fwd = StaticForward(model)
    g = torch.Generator().manual_seed(0)
    U, T, steps = 3, 9, 6
    ids = torch.randint(3, model.config.vocab_size, (U, T + steps), generator=g)
    with torch.no_grad():
        want = ref(ids).logits[:, T - 1:]
    cache = fwd.new_cache(4, 64, "cpu")
    got = [fwd.prefill(cache, ids[:, :T], torch.full((U,), T), torch.arange(U))]
    got += [fwd.decode(cache, ids[:, T + s], torch.full((U,), T + s), 64) for s in range(steps)]
    assert (torch.stack(got, 1) - want).abs().max() <= 1e-5


def test_decode_stores_k_and_v_at_each_rows_position(models):
    """One decode step of ragged rows writes K and V (one indexed write per layer) at (row b, pos[b])
    and nowhere else, equal to what a prefill of the one-longer prompt stores there (float32; the
    same projections of one token, other batch shapes: measured <= 6.0e-7, bound 1e-5)."""
    from megaforge.rollout.embedded.fast.forward import StaticForward

    fwd = StaticForward(copy.deepcopy(models["qwen3"]))
    g = torch.Generator().manual_seed(5)
    lens = [3, 9, 5]
    ids = [torch.randint(3, 512, (n + 1,), generator=g) for n in lens]
    pad = lambda seqs, T: torch.stack([torch.cat([s, torch.zeros(T - len(s), dtype=torch.long)]) for s in seqs])
    cache, full = fwd.new_cache(3, 32, "cpu"), fwd.new_cache(3, 32, "cpu")
    U = torch.arange(3)
    fwd.prefill(cache, pad([s[:-1] for s in ids], 9), torch.tensor(lens), U)
    fwd.prefill(full, pad(ids, 10), torch.tensor(lens) + 1, U)
    before = [t.clone() for t in cache.kv]
    pos = torch.tensor(lens)
    fwd.decode(cache, torch.stack([s[-1] for s in ids]), pos, 16)
    for li, (t, t0, ref) in enumerate(zip(cache.kv, before, full.kv)):
        changed = (t != t0).any(-1).any(2)  # [2, B, L]: positions whose K or V changed
        want = torch.zeros_like(changed)
        want[:, U, pos] = True
        assert torch.equal(changed, want), li
        assert (t[:, U, :, pos] - ref[:, U, :, pos]).abs().max() <= 1e-5


def test_fused_tensors_are_the_parameters_storage(models):
    """After the fast path is built the q/k/v and gate/up parameters (the same objects, the same
    values) view the fused tensors; a second engine on the model reuses them; a rebound parameter is
    an error naming the layer, not stale weights."""
    model = copy.deepcopy(models["qwen2"])
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    eng = _fast(model)
    assert dict(model.named_parameters()) == params  # identities kept
    for n, p in model.named_parameters():
        assert torch.equal(p, values[n]), n
    f = eng.fast.fwd.fused[1]
    a = model.model.layers[1].self_attn
    assert a.k_proj.weight.data_ptr() == f["qkv_w"][f["q"]].data_ptr()
    assert a.v_proj.bias.data_ptr() == f["qkv_b"][f["q"] + f["kv"]:].data_ptr()
    assert model.model.layers[1].mlp.up_proj.weight.data_ptr() == f["gate_up_w"][f["ff"]].data_ptr()
    assert f["gate_up_b"] is None
    again = _fast(model)
    assert again.fast.fwd.fused[1]["qkv_w"].data_ptr() == f["qkv_w"].data_ptr()  # not copied again
    reqs = _reqs(_prompts(2), temperature=0.0, max_new_tokens=4)
    _same(eng.generate(reqs), again.generate(reqs))
    a.k_proj.weight = torch.nn.Parameter(a.k_proj.weight.detach().clone())
    with pytest.raises(RuntimeError, match="layer 1: a projection weight no longer views the fused"):
        eng.generate(reqs)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_layer_pieces_equal_the_eager_pieces(models, family):
    """The per-layer pieces and the sampler's draw through torch.compile (backend "eager" here: dynamo
    traces them, no code generation) give the eager pieces' tokens and logprobs."""
    model = models[family]
    reqs = [GenerateRequest(p, SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=9, seed=i))
            for i, p in enumerate(_prompts(5))]
    ref = _fast(model, max_batch=3).generate(reqs)
    eng = _fast(model, max_batch=3, compile="eager")
    assert eng.fast.fwd.compiled is not None
    # backend "eager": dynamo runs the same aten ops in the same order, so bit-identical on one
    # machine (measured 0.0 on every kernel set); 1e-6 leaves 1-2 ulp
    _same(eng.generate(reqs), ref, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compile", [None, "eager"])
def test_matmul_attention_equals_sdpa(models, family, compile):
    """attention="matmul" (two batched matmuls around a float32 softmax) answers as the SDPA path:
    float32 on the CPU, the same scores summed in another order (<= 1e-6 apart, see _same)."""
    model = models[family]
    reqs = [GenerateRequest(p, SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=9, seed=i))
            for i, p in enumerate(_prompts(5))] + _reqs(_prompts(3, seed=1), temperature=0.0, max_new_tokens=7)
    ref = _fast(model, max_batch=3, attention="sdpa").generate(reqs)
    from megaforge.rollout.embedded.fast.forward import matmul_attention

    eng = _fast(model, max_batch=3, attention="matmul", compile=compile)
    assert eng.fast.fwd.attention == "matmul"
    assert (eng.fast.fwd.matmul_attention is matmul_attention) == (compile is None)  # compiled with the pieces
    _same(eng.generate(reqs), ref)
    with pytest.raises(ValueError, match="attention 'flash': valid: auto, sdpa, matmul"):
        _fast(model, attention="flash")


def test_auto_attention_follows_query_heads_per_kv_head(models):
    """attention "auto": matmul for at most MATMUL_MAX_GROUPS query heads per KV head, else sdpa."""
    from megaforge.rollout.embedded.fast.forward import MATMUL_MAX_GROUPS

    from transformers import Qwen2Config, Qwen2ForCausalLM

    wide = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=8, num_key_value_heads=1)).eval()  # 8 per KV head
    for model in [*models.values(), wide]:
        fwd = _fast(model).fast.fwd
        assert fwd.attention == ("matmul" if fwd.groups <= MATMUL_MAX_GROUPS else "sdpa"), fwd.groups
    assert models["qwen2"].config.num_attention_heads // models["qwen2"].config.num_key_value_heads <= MATMUL_MAX_GROUPS
    assert _fast(wide).fast.fwd.attention == "sdpa"


def test_selection_and_config(models, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from megaforge.config import config_from_dict
    from megaforge.configtree import ConfigError

    model = models["qwen2"]
    assert EmbeddedEngine(model, None, fast="auto").fast is None  # CPU: the simple loop
    assert EmbeddedEngine(model, None, fast="off").fast is None
    with pytest.raises(ValueError, match="valid: auto, on, off"):
        EmbeddedEngine(model, None, fast="yes")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        EmbeddedEngine(gpt2, None, fast="on")
    assert EmbeddedEngine(gpt2, None, fast="auto").fast is None
    base = {"output_dir": str(tmp_path), "max_steps": 0, "model": {"path": "x"}}
    assert config_from_dict({**base, "rollout": {"fast": "on"}}).rollout.fast == "on"
    assert config_from_dict(base).rollout.fast == "auto"
    with pytest.raises((ConfigError, ValueError), match="rollout.fast"):
        config_from_dict({**base, "rollout": {"fast": "maybe"}})
    from megaforge.rollout.embedded.engine import fast_options

    assert fast_options("auto", "auto", torch.device("cpu")) == {"compile": None, "attention": "auto"}
    assert fast_options("auto", "sdpa", torch.device("cuda")) == {"compile": "inductor", "attention": "sdpa"}
    assert fast_options("off", "matmul", torch.device("cuda")) == {"compile": None, "attention": "matmul"}
    cfg = config_from_dict({**base, "model": {"path": "", "config": os.path.join(ROOT, "configs", "models", "tiny-qwen2")},
                            "rollout": {"dtype": "bfloat16", "device": "cpu", "fast": "on", "fast_compile": "off"}})
    assert cfg.engine_dtype == "bfloat16" and cfg.model.dtype == "float32"
    from megaforge.build import RunBuilder

    eng = EmbeddedEngine.from_spec(RunBuilder(cfg).engine_spec())
    assert next(eng.model.parameters()).dtype == torch.bfloat16 and eng.fast.fwd.compiled is None


def test_buckets():
    for n in range(1, 3000, 7):
        for fn, cap in ((batch_bucket, 5000), (kv_bucket, 5000), (prefill_bucket, 5000)):
            b = fn(n, cap)
            assert n <= b <= cap and fn(b, cap) == b
        assert kv_bucket(n, 5000) - n < max(128, n // 4 + 1)
    assert batch_bucket(5, 6) == 6 and kv_bucket(300, 200) == 200 and prefill_bucket(3, 8) == 8
    assert len({kv_bucket(n, 4096) for n in range(1, 4097)}) <= 20


def test_bench_tool_runs_on_cpu():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "bench_rollout.py"), "--tiny", "--quick",
                        "--batches", "4", "--new", "6", "--prompt", "5"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])["shapes"]["tiny"]["batches"]["4"]
    assert row["hf"]["tokens"] == row["fast"]["tokens"] == 4 * 6
    assert row["ratio"] > 0 and row["fast"]["warmup_s"] > 0


@pytest.mark.slow  # ~19 s; the tool on the CPU: test_bench_tool_runs_on_cpu; against real SGLang: docs/benchmarks
def test_bench_tool_against_a_server_repeats_and_reports_the_median():
    """--sglang with megaforge's embedded server standing in for SGLang (the GPU runs the real one):
    --repeats timed runs per side, every run's tok/s and the median's tokens; --variants picks the
    fast engine's forms."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "bench_rollout.py"), "--sglang", "--sglang_server",
                        "embedded", "--tiny", "--batches", "4", "--new", "6", "--prompt", "5", "--repeats", "3",
                        "--variants", "fast,fast_default"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["repeats"] == 3
    row = out["shapes"]["tiny"]["batches"]["4"]
    assert sorted(row) == ["fast", "fast_default", "ratio", "ratio_default", "sglang"]
    for side in ("sglang", "fast"):
        runs = row[side]["tok_s_runs"]
        assert len(runs) == 3 and row[side]["tok_s"] == sorted(runs)[1] and row[side]["tokens"] == 4 * 6
    assert row["ratio"] == round(row["fast"]["tok_s"] / row["sglang"]["tok_s"], 3)


def test_bench_timed_runs_takes_the_median_run():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from common import timed_runs

    got = timed_runs([(100, 1.0), (90, 0.3), (100, 0.5), (100, 2.0)])  # 100, 300, 200, 50 tok/s
    assert got == {"tok_s": 100.0, "wall_s": 1.0, "tokens": 100, "tok_s_runs": [100.0, 300.0, 200.0, 50.0]}
    assert timed_runs([(10, 0.5)])["tok_s"] == 20.0


@pytest.mark.slow
def test_inductor_on_cpu_answers_as_the_eager_pieces(models):
    """The fast path with compile "inductor" (generated C++ on the CPU: the lowering the GPU's Triton
    shares) answers as the eager pieces: layer pieces, prefill, matmul attention, the Gumbel draw
    (whose per-token stream offsets are an input: inductor's CPU code for int64 ``arange * constant``
    was wrong, see sampling.vocab_offsets). float32, other fusions: within _same's bounds. ~15 s of
    compilation, hence slow."""
    model = models["qwen3"]
    reqs = [GenerateRequest(p, SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=9, seed=i))
            for i, p in enumerate(_prompts(5))] + _reqs(_prompts(3, seed=1), temperature=0.0, max_new_tokens=7)
    ref = _fast(model, max_batch=3, attention="matmul").generate(reqs)
    _same(_fast(model, max_batch=3, attention="matmul", compile="inductor").generate(reqs), ref)
