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
