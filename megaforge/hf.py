"""Loading Hugging Face models and tokenizers the same way everywhere (trainer, engines, tests)."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megaforge import model_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(RuntimeError):
    """A device the config asks for does not exist here."""


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``; an absent device is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise DeviceError(f"device {name!r}: {e}") from None
    if dev.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise DeviceError(f"device {name!r} requested but this machine has no CUDA GPU "
                              f"(set trainer.device / rollout.device to cpu or auto)")
        if dev.index is not None and dev.index >= have:
            raise DeviceError(f"device {name!r} requested but this machine has {have} GPU(s)")
    return dev


class ModelSourceError(OSError):
    """A model or tokenizer named by the config is neither a folder here nor loadable from the hub."""


def from_pretrained(field: str, source: str, load, **kw):
    """``load(source, **kw)`` (a transformers ``from_pretrained``), its OSError re-raised naming the
    config ``field`` and, for a relative path, the directory it was read from (relative paths are
    read from the current directory, not from the config file's). A path that looks local and is not
    there, or a hub id not cached under HF_HUB_OFFLINE, fails at once (megaforge.model_source)."""
    why = model_source.problem(field, source)
    if why:
        raise ModelSourceError(why)
    try:
        return load(source, **kw)
    except OSError as e:
        where = ""
        if not os.path.isabs(source) and not os.path.exists(source):
            where = (f"; no such folder under the current directory {os.getcwd()} (relative paths are read "
                     f"from there: run from the repository root or give an absolute path)")
        raise ModelSourceError(f"{field} {source!r}: cannot be loaded{where}; transformers said: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def load_tokenizer(model_cfg):
    from transformers import AutoTokenizer

    path = model_cfg.tokenizer or model_cfg.path
    if not path:
        raise ValueError("model.tokenizer: set a tokenizer (or model.path)")
    field = "model.tokenizer" if model_cfg.tokenizer else "model.path"
    tok = from_pretrained(field, path, AutoTokenizer.from_pretrained, trust_remote_code=model_cfg.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def hf_config(model_cfg):
    """The transformers config of the policy (from model.path, else model.config)."""
    from transformers import AutoConfig

    if model_cfg.path:
        return from_pretrained("model.path", model_cfg.path, AutoConfig.from_pretrained,
                               trust_remote_code=model_cfg.trust_remote_code)
    src = model_cfg.config
    if os.path.isdir(src):
        src = os.path.join(src, "config.json")
    if not os.path.exists(src):
        raise FileNotFoundError(f"model.config {model_cfg.config!r}: no config.json there (relative paths are "
                                f"read from the current directory {os.getcwd()})")
    with open(src) as f:
        data = json.load(f)
    mt = data.get("model_type")
    if not mt:
        raise ValueError(f"model.config {src}: no 'model_type' field")
    return AutoConfig.for_model(**data)


def load_hf_model(model_cfg, device: torch.device, dtype: Optional[torch.dtype] = None):
    """The policy as a transformers CausalLM on ``device`` (pretrained, or seeded random init)."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or DTYPES[model_cfg.dtype]
    if model_cfg.path:
        model = from_pretrained(
            "model.path", model_cfg.path, AutoModelForCausalLM.from_pretrained, dtype=dtype,
            attn_implementation=model_cfg.attn_implementation, trust_remote_code=model_cfg.trust_remote_code,
        )
    else:
        config = hf_config(model_cfg)
        config._attn_implementation = model_cfg.attn_implementation
        # initialised where it will live: a 2B model's random init takes minutes on one CPU core and
        # well under a second on a GPU (the values are seeded per device type)
        devices = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.device(device):
            torch.manual_seed(model_cfg.init_seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device)


def hf_state_names(model, names=None) -> list[str]:
    """Names of the tensors ``save_pretrained`` writes (tied duplicates left out), of ``model``'s state
    or of the given ``names`` (e.g. a LoRA-adapted model's base names)."""
    sd = model.state_dict() if names is None else names
    tied: set[str] = set()
    if getattr(model.config, "tie_word_embeddings", False):
        keys = getattr(model, "_tied_weights_keys", None)  # dict {tied: source} (v5) or list (v4)
        tied = set(keys) if keys else {"lm_head.weight"}
    return [k for k in sd if k not in tied]
