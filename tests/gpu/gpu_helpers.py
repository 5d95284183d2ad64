"""Helpers of the GPU tests: the SGLang environment they run the server in (see conftest.py), the rollout
section and the tiny Qwen3 model the SGLang tests serve, and the JSON report their figures go to."""
from __future__ import annotations

import json
import os
import time

from megaforge.build import RunBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "assets", "tiny-tokenizer")
# Triton attention: the GPU machine's SGLang kit drops sgl_kernel's FA3 kernels (tools/gpu/README.md); the torch
# sampler and no CUDA graphs keep a test server's start short.
SGLANG_TEST_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph",
                    "--log-level", "info"]


def sglang_rollout(**over) -> dict:
    """The ``rollout`` section of a test server: SGLang from the environment conftest.py names, 30% of the GPU,
    SGLANG_TEST_ARGS; ``over`` adds or replaces keys."""
    return {"engine": "sglang", "engine_env": sglang_env(), "engine_python": sglang_python(),
            "extra_args": SGLANG_TEST_ARGS, "mem_fraction": 0.3, "startup_timeout_s": 900.0,
            "request_timeout_s": 300.0, **over}


def serving(cfg, report=None, key: str = "server_start_s"):
    """A module fixture's body: the SGLang server ``build_engine`` starts for ``cfg`` (its start-up seconds go to
    ``report`` under ``key``), shut down after the module and checked to have left no process alive."""
    from megaforge.hf import load_tokenizer
    from megaforge.rollout import build_engine

    t = time.perf_counter()
    eng = build_engine(RunBuilder(cfg).engine_spec(), load_tokenizer(cfg.model))
    if report is not None:
        report(key, round(time.perf_counter() - t, 1))
    yield eng
    eng.shutdown()
    assert not any(p.alive() for p in eng.processes)


class JsonReport:
    """``report(key, value)`` records a figure and rewrites the JSON file ``$env_var`` names (nothing when unset),
    so a test run stopped half-way keeps what it measured."""

    def __init__(self, env_var: str):
        self.env_var, self.figures = env_var, {}

    def __call__(self, key: str, value) -> None:
        self.figures[key] = value
        path = os.environ.get(self.env_var)
        if path:
            with open(path, "w") as f:
                json.dump(self.figures, f, indent=1, default=str)


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
