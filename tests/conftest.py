"""Shared test fixtures: tiny random HF models saved to disk (nothing from a hub), the repo tokenizer."""
from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TOKENIZER = os.path.join(ROOT, "assets", "tiny-tokenizer")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("ATEN_CPU_CAPABILITY"):
    # torch.compile's on-disk cache key ignores the vector ISA that ATEN_CPU_CAPABILITY selects: a CPU
    # kernel compiled under one setting is loaded under another and computes garbage (the fused-logprob
    # test was 5.2 off after a run with another setting). One cache per setting (subprocesses inherit it).
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"))
torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_model(path: str, family: str = "qwen2", seed: int = 0, vocab: int = 512, tie: bool = True, **kw) -> str:
    """Save a tiny random model of a real architecture to ``path``; returns ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    args = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=tie, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    if family == "qwen3":
        args["head_dim"] = 16
    args.update(kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**args), dtype=torch.float32)
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)
