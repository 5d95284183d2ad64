"""Helpers of the checkpoint-conversion tests: tiny HF models of every family, multi-process
launches (tests/megatron/mt_helpers.run_ranks), HF loading with transformers' logging captured.

Models (4 layers, hidden 64, 4 query / 2 key-value heads; norms and biases perturbed so they
matter; MoE router weights scaled so routing is far from uniform):

* ``llama_tied``: Llama, tied embeddings, vocabulary 509 (Megatron pads it to 512), float32;
* ``qwen2``: Qwen2 (qkv bias), vocabulary 509, bfloat16;
* ``qwen3_tied``: Qwen3 (q/k norm, head_dim 24), tied, vocabulary 300 (padded to 512 at TP=2 but 384
  at TP=1: loading at another TP re-pads), bfloat16;
* ``qwen3_moe``: Qwen3-MoE, 4 experts top-2 with ``norm_topk_prob``, layer 0 dense
  (``mlp_only_layers``), vocabulary 509, float32.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "megatron"))
WORKER = os.path.join(HERE, "cv_worker.py")
TOKENIZER = os.path.join(ROOT, "assets", "tiny-tokenizer")

from mt_helpers import run_workers  # noqa: E402

MODELS = {
    "llama_tied": dict(kind="llama", vocab=509, tied=True, dtype="float32", seed=11),
    "qwen2": dict(kind="qwen2", vocab=509, tied=False, dtype="bfloat16", seed=12),
    "qwen3_tied": dict(kind="qwen3", vocab=300, tied=True, dtype="bfloat16", seed=13),
    "qwen3_moe": dict(kind="qwen3_moe", vocab=509, tied=False, dtype="float32", seed=14),
}


def hf_config(kind: str, vocab: int, tied: bool, **over):
    import transformers

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tied,
              eos_token_id=2, pad_token_id=0, bos_token_id=None)
    if kind in ("qwen3", "qwen3_moe"):
        kw["head_dim"] = 24
    if kind == "qwen3_moe":
        kw.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                  mlp_only_layers=[0], decoder_sparse_step=1)
    kw.update(over)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "qwen3_moe": transformers.Qwen3MoeConfig}[kind]
    return cls(**kw)


def make_model(path: str, kind: str, vocab: int, tied: bool, dtype: str, seed: int, **over) -> str:
    """Save a tiny random HF model (safetensors, tokenizer) to ``path``; returns ``path``."""
    import transformers

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, vocab, tied, **over), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    return path


def run_worker(scenario: str, nprocs: int, spec: dict, workdir, timeout: float = 400.0) -> list:
    """``cv_worker.py scenario`` on ``nprocs`` gloo ranks; each rank's result object."""
    return run_workers(scenario, nprocs, spec, workdir, timeout, worker=WORKER)


def hf_state(path: str) -> dict:
    """Every tensor of an HF directory as stored (names, dtypes), via the index if sharded."""
    from megaforge.convert.mapping import HFSource

    src = HFSource(path=path)
    return {n: src(n) for n in src.names()}


@contextlib.contextmanager
def captured_transformers_log():
    """Capture transformers' log records (warnings about missing / unexpected keys included)."""
    from transformers.utils import logging as tlog

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setLevel(logging.DEBUG)
    logger = tlog.get_logger("transformers")
    old = tlog.get_verbosity()
    tlog.set_verbosity_info()
    logger.addHandler(handler)
    try:
        yield buf
    finally:
        logger.removeHandler(handler)
        tlog.set_verbosity(old)


def load_hf_checked(path: str, dtype=torch.float32):
    """(model, log text): ``from_pretrained`` with its loading report; raises if transformers reports
    missing, unexpected or mismatched keys."""
    import transformers

    with captured_transformers_log() as buf:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    log = buf.getvalue()
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"{path}: transformers loading info {bad}"
    for word in ("missing", "unexpected", "newly initialized", "not used", "mismatch"):
        assert word not in log.lower(), f"{path}: transformers logged {word!r}:\n{log}"
    return model.eval(), log
