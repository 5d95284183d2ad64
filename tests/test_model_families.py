"""Issue 42 point 3: one home per model family's facts (megaforge.model_families). A toy family with
Llama-style modules is one registration: the planner describes its shapes and the embedded engine's
fast path decodes it (same tokens as the simple loop); the modules that restate facts agree with it."""
import torch

from megaforge.model_families import MODEL_FAMILIES, ModelFamily, model_family, model_types

BUILT_IN = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
TOY = "toy_llama_42"
if TOY not in MODEL_FAMILIES:
    MODEL_FAMILIES.register(TOY, ModelFamily(qk_norm=False, fast_decode=True))  # the one registration


def _tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, pad_token_id=0,
                      bos_token_id=None)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_the_planner_describes_a_registered_family():
    from megaforge.planner.shapes import KNOWN_TYPES, shape_from_dict

    d = dict(model_type=TOY, num_attention_heads=4, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
             intermediate_size=64, vocab_size=128, attention_bias=True)
    shape = shape_from_dict(d)
    assert TOY in KNOWN_TYPES and not shape.megatron_supported  # no megatron parameter table registered
    assert shape.qkv_bias and shape.o_bias and not shape.qk_norm and not shape.is_moe  # the entry's facts
    q = shape_from_dict({**d, "model_type": "qwen2"})
    assert q.qkv_bias and not q.o_bias  # Qwen2: biased q/k/v, unbiased o_proj, as registered


def test_the_fast_path_decodes_a_registered_family_like_the_simple_loop():
    from megaforge.rollout.embedded import EmbeddedEngine
    from megaforge.rollout.embedded.fast import FastDecoder, supported, unsupported_reason
    from megaforge.types import GenerateRequest, SamplingParams

    model = _tiny_llama()
    model.config.model_type = TOY
    assert TOY in supported() and unsupported_reason(model) is None
    model.config.model_type = "toy_unregistered_42"
    assert "toy_unregistered_42" in unsupported_reason(model)
    model.config.model_type = TOY
    fast = EmbeddedEngine(model, None, max_batch=2, fast="on", fast_options=dict(chunk=4))
    assert isinstance(fast.fast, FastDecoder)
    simple = EmbeddedEngine(model, None, max_batch=2, fast="off")
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=6, temperature=0.0), f"r{i}")
            for i, p in enumerate([[5, 9, 11], [7, 3, 30, 41, 12]])]
    # exact: greedy tokens of one float32 model; a token flips only at a top-2 logit gap within the two
    # paths' rounding (~1e-6; tests/rollout/embedded/test_fast_engine.py compares them the same way)
    got, want = fast.generate(reqs), simple.generate(reqs)
    assert [c.output_ids for c in got] == [c.output_ids for c in want] and all(c.output_ids for c in got)


def test_modules_that_restate_family_facts_agree_with_the_registry():
    from megaforge.convert import families

    # transformers 5's CausalLM forward is lm_head(decoder(...).last_hidden_state) alone for these (router
    # aux losses only with labels); trainer/causal_lm.check_split_head reads the registry
    assert {t for t in BUILT_IN if model_family(t).split_head} == {"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}
    megatron = {t for f in families.FAMILIES.values() for t in f.model_types}
    assert {t for t in model_types(megatron=True)} == megatron
