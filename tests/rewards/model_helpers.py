"""Tiny random models for the reward tests, saved with save_pretrained (nothing from a hub)."""
from __future__ import annotations

import os

import torch

TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets",
                         "tiny-tokenizer")


def make_tiny_reward_model(path: str, num_labels: int = 1, seed: int = 0) -> str:
    """A Qwen2ForSequenceClassification (2 layers, hidden 64, one output) with the repo tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      num_labels=num_labels, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # the random head's std 0.02 gives scores ~1e-2: spread them so that they differ clearly
        model.score.weight.mul_(50.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    return path


def make_scripted_judge(path: str, answers: dict[int, str], context: int = 256) -> str:
    """A tiny Qwen2 CausalLM whose greedy answer depends only on the prompt's last token:
    ``answers[last token id]`` followed by <|im_end|>; after any other token it writes token 0 (no
    verdict). Built by hand: attention and MLP outputs are zero (o_proj, down_proj), so the hidden
    state at a position is its token's embedding, and the embeddings and the untied lm_head form a
    bigram table (each source token a unit vector of its own, each target's row the sum of its
    sources' vectors; logit 8 x 10 for the chosen next token, 0 for the others)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    nxt: dict[int, int] = {}
    for last, text in answers.items():
        chain = [last] + tok(text, add_special_tokens=False)["input_ids"] + [eos]
        for a, b in zip(chain, chain[1:]):
            if nxt.setdefault(a, b) != b:
                raise ValueError(f"token {a} would need two successors: choose answers without shared tokens")
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=False, eos_token_id=eos, pad_token_id=0, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if len(nxt) > cfg.hidden_size:
        raise ValueError("more source tokens than hidden dimensions")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for k, (a, b) in enumerate(nxt.items()):
            model.model.embed_tokens.weight[a, k] = 1.0
            model.lm_head.weight[b, k] = 10.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
