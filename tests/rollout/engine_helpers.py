"""Helpers of the HTTP engine tests: tiny models, raw HTTP, HF oracles, configs."""
from __future__ import annotations

import json
import os
import struct
import urllib.error
import urllib.request

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "assets", "tiny-tokenizer")

# Malicious /update_weights_from_tensor pickles (issue 21). A BUILD on the class torch.UntypedStorage
# with slot state {"_new_shared_filename_cpu": None}: an unpickler that resolves the class sets the
# attribute on it, and every later shared-memory update of that process fails.
BUILD_ON_CLASS = (b"\x80\x04" + b"ctorch.storage\nUntypedStorage\n" + b"N}" + b"\x8c\x18_new_shared_filename_cpu"
                  + b"Ns" + b"\x86" + b"b" + b".")
# bytearray(2**32) from 35 bytes: REDUCE of builtins.bytearray on a LONG1
BYTEARRAY_CALL = b"\x80\x04cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x00\x01\x85R."
# the BYTEARRAY8 opcode of protocol 5 with a declared length of 2**32 (the C unpickler allocates first)
BYTEARRAY8 = b"\x80\x05\x96" + struct.pack("<Q", 1 << 32) + b"."


def save_tiny_qwen2(path: str, seed: int = 0, max_positions: int = 4096) -> str:
    """A tiny random Qwen2 (2 layers, hidden 64, vocab 512 = the repo tokenizer's) saved with
    ``save_pretrained``, with the repo tokenizer next to it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=True,
                      eos_token_id=2, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    return path


def http(url: str, method: str, path: str, body=None, token: str | None = None, timeout: float = 60.0):
    """(status, parsed JSON or text) of one raw HTTP call."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode()


def hf_output_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[t] | prompt + output[:t]) under ``model`` (temperature 1), float32 [len(output)]."""
    seq = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, seq[0, 1:, None]).squeeze(-1)
    return lp[len(prompt) - 1:]


def perturbed_state(model_dir: str, seed: int) -> tuple[object, list[tuple[str, torch.Tensor]]]:
    """A model with new random weights (same architecture) and its HF-named tensors."""
    from transformers import AutoModelForCausalLM

    from megaforge.hf import hf_state_names

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    sd = m.state_dict()
    return m, [(n, sd[n].detach().clone()) for n in hf_state_names(m)]


def buckets_of(named, n: int):
    k = -(-len(named) // n)
    return [named[i:i + k] for i in range(0, len(named), k)]


def engine_config(tmp_path, model_dir: str, **rollout):
    from megaforge.config import config_from_dict

    return config_from_dict({
        "output_dir": str(tmp_path), "run_name": "srv", "max_steps": 0,
        "model": {"path": model_dir, "tokenizer": TOKENIZER, "dtype": "float32"},
        "rollout": {"engine": "embedded_server", "device": "cpu", "startup_timeout_s": 180.0, **rollout},
    })
