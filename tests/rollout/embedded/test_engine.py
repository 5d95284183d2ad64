"""The embedded engine: greedy equals HF generate, logprobs equal the trainer's, sampling controls."""
import pytest
import torch

from megaforge.rollout.base import EngineStateError
from megaforge.rollout.embedded import EmbeddedEngine
from megaforge.rollout.embedded.sampling import process_logits, sample_tokens
from megaforge.trainer.logprobs import token_logprobs
from megaforge.types import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _prompts(tokenizer):
    texts = ["What is 1 + 2?", "What is 7 - 3? Think.", "hi"]
    return [tokenizer(t)["input_ids"] for t in texts]


def test_greedy_equals_hf_generate(model, tokenizer):
    eng = EmbeddedEngine(model, tokenizer, max_batch=8)
    prompts = _prompts(tokenizer)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    outs = eng.generate([GenerateRequest(p, sp, f"r{i}") for i, p in enumerate(prompts)])
    for p, o in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert o.output_ids == ref[0, len(p):].tolist()
        assert o.finish_reason == "length" and len(o.output_logprobs) == 12


def test_logprobs_equal_trainer_forward(model, tokenizer):
    eng = EmbeddedEngine(model, tokenizer, max_batch=8)
    prompts = _prompts(tokenizer)
    sp = SamplingParams(temperature=0.7, max_new_tokens=10, seed=1)
    outs = eng.generate([GenerateRequest(p, sp) for p in prompts])
    for p, o in zip(prompts, outs):
        seq = torch.tensor([p + o.output_ids])
        with torch.no_grad():
            logits = model(seq).logits
        lp, _ = token_logprobs(logits, seq, torch.tensor([seq.shape[1]]), temperature=0.7)
        got = torch.tensor(o.output_logprobs)
        # float32 logprobs (|lp| <= ~8) of the KV-cached decode vs one full forward: other sum orders,
        # ~1 ulp (<= 9.5e-7 measured); atol 1e-5 (+ rtol 1e-5) is >= 10x
        assert torch.allclose(lp[0, len(p):], got, atol=1e-5), (lp[0, len(p):] - got).abs().max()


def test_stop_tokens_max_tokens_and_seeds(model, tokenizer):
    eng = EmbeddedEngine(model, tokenizer, max_batch=2)  # several engine batches
    p = _prompts(tokenizer)[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7)
    a = eng.generate([GenerateRequest(p, sp) for _ in range(3)])
    b = eng.generate([GenerateRequest(p, sp) for _ in range(3)])
    assert [x.output_ids for x in a] == [x.output_ids for x in b]  # seeded: reproducible
    first = a[0].output_ids[3]
    stopped = eng.generate([GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=20, seed=7,
                                                              stop_token_ids=[first]))])[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids[-1] == first
    assert first not in stopped.output_ids[:-1]


def test_top_k_top_p_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    one = torch.ones(1)
    z = process_logits(logits, one, torch.tensor([2]), one)
    assert torch.isinf(z[0, 2:]).all() and torch.isfinite(z[0, :2]).all()
    p = torch.softmax(logits[0], -1)  # [0.61, 0.22, 0.14, 0.03]
    z = process_logits(logits, one, torch.tensor([-1]), torch.tensor([0.7]))
    assert torch.isfinite(z[0, :2]).all() and torch.isinf(z[0, 2:]).all()  # 0.61 < 0.7 <= 0.83
    tok, lp = sample_tokens(logits.repeat(200, 1), torch.ones(200), torch.full((200,), 2), torch.ones(200),
                            torch.Generator().manual_seed(0))
    q = p[:2] / p[:2].sum()
    assert set(tok.tolist()) <= {0, 1}
    # logprob under the truncated distribution: a 2-way log-softmax of values <= 2 in float32 (1 ulp
    # 2.4e-7) against float32 log of the renormalised probabilities
    assert torch.allclose(lp, q.log()[tok], atol=1e-6)
    tok, lp = sample_tokens(logits, torch.zeros(1), torch.tensor([-1]), one)
    assert tok.item() == 0 and torch.allclose(lp, p.log()[0:1])


def test_memory_state_is_tracked(model, tokenizer):
    eng = EmbeddedEngine(model, tokenizer)
    eng.release_memory(["weights", "kv_cache"])
    with pytest.raises(EngineStateError, match="released"):
        eng.generate([GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))])
    with pytest.raises(EngineStateError, match="resume 'weights' first"):
        eng.update_weights([], 1)
    with pytest.raises(ValueError, match="unknown memory tag"):
        eng.release_memory(["gpu"])
    eng.resume_memory(["weights", "kv_cache"])
    assert eng.generate([GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))])[0].output_ids


def test_update_weights_by_name(model, tokenizer):
    import copy

    eng = EmbeddedEngine(copy.deepcopy(model), tokenizer)
    w = torch.zeros_like(model.state_dict()["model.norm.weight"])
    eng.update_weights([[("model.norm.weight", w)]], version=3)
    assert eng.weight_version == 3 and torch.equal(eng.model.state_dict()["model.norm.weight"], w)
    with pytest.raises(KeyError, match="no tensor 'model.nope'"):
        eng.update_weights([[("model.nope", w)]], 4)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        eng.update_weights([[("model.norm.weight", torch.zeros(3))]], 4)
