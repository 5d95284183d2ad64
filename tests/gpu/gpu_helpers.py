"""Helpers of the GPU tests: the SGLang environment they run the server in (see conftest.py), and the tiny
Qwen3 model the SGLang tests serve."""
from __future__ import annotations

import os

from megaforge.build import RunBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "assets", "tiny-tokenizer")


def save_tiny_qwen3(d: str, seed: int = 0, embed_scale: float = 1.0) -> str:
    """A random-init 2-layer Qwen3 (hidden 256, 4 query / 2 KV heads of 128, vocabulary 512, tied embeddings),
    bfloat16, with the tiny tokenizer, saved as an HF folder ``d``; ``embed_scale`` multiplies the embeddings
    (a larger one gives a less uniform next-token distribution). Returns ``d``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=128,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if embed_scale != 1.0:
        with torch.no_grad():
            m.model.embed_tokens.weight.mul_(embed_scale)
    m.save_pretrained(d)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(d)
    return d


def sglang_env() -> dict:
    """The environment variables ``MEGAFORGE_SGLANG_ENV_SH`` sets or changes ({} when unset)."""
    from megaforge.supervise import env_from_script

    path = os.environ.get("MEGAFORGE_SGLANG_ENV_SH", "")
    return env_from_script(path) if path else {}


def sglang_python() -> str:
    return os.environ.get("MEGAFORGE_SGLANG_PYTHON", "")


def sglang_version() -> str | None:
    from megaforge.config import config_from_dict
    from megaforge.configtree import ConfigError
    from megaforge.rollout.http.start import require_sglang

    cfg = config_from_dict({"model": {"config": os.path.join(ROOT, "configs", "models", "tiny-qwen2")}, "max_steps": 0,
                            "rollout": {"engine": "sglang", "engine_env": sglang_env(),
                                        "engine_python": sglang_python()}})
    try:
        return require_sglang(RunBuilder(cfg).engine_spec())
    except ConfigError:
        return None
