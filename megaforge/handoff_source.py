"""Weights handed from one megaforge run to the next: a *run source* is a run folder (its newest complete
checkpoint) or one of its checkpoints (``<run>/checkpoints/<name>``, holding ``trainer/``). ``model.path``
of a run (SFT -> GRPO: megaforge.loop.Run) and ``--model`` of tools/evaluate.py accept one; its policy
weights are written as a Hugging Face folder first (:func:`export`), which is then loaded like any other.

The policy comes out as the source run trained it: the torch backend's saved state dict loaded into the
source run's model (its ``config.yaml``'s ``model.*``), the Megatron backend's dist checkpoint through
tools/convert_megatron_to_hf.py (its own process). Paths in a run's ``config.yaml`` are relative to the
folder that run was started from, as every config path is.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Callable, Optional

from megaforge.configtree import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SourceError(ConfigError):
    """A run source that cannot be used (no complete checkpoint, not a run, weights that do not fit)."""


def is_run_source(path: str) -> bool:
    """``path`` is a folder without a Hugging Face ``config.json`` that holds a run's ``checkpoints/`` or
    a checkpoint's ``trainer/``."""
    return (bool(path) and os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json"))
            and any(os.path.isdir(os.path.join(path, d)) for d in ("checkpoints", "trainer")))


def locate(path: str, name: str, log: Callable[[str], None] = lambda m: None) -> Optional[str]:
    """The checkpoint folder ``path`` stands for, or None for a Hugging Face folder (``config.json``).
    ``name`` (the config key or flag) starts every error. SourceError for a folder that is neither, a
    run without a complete checkpoint, or an incomplete checkpoint."""
    from megaforge import checkpoint  # lazy: torch

    if not os.path.isdir(path):
        raise SourceError(f"{name} {path}: no such folder")
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    if os.path.isdir(os.path.join(path, "checkpoints")):
        ckpt = checkpoint.latest_valid(os.path.join(path, "checkpoints"), log=log)
        if ckpt is None:
            raise SourceError(f"{name} {path}: the run has no complete checkpoint under checkpoints/")
        return ckpt
    if os.path.isdir(os.path.join(path, "trainer")):
        why = checkpoint.verify(path)
        if why is not None:
            raise SourceError(f"{name} {path}: not a usable checkpoint: {why}")
        return path
    raise SourceError(f"{name} {path}: neither an HF folder (config.json) nor a run / run checkpoint")


def run_dir_of(ckpt: str) -> str:
    """The run folder of checkpoint ``ckpt`` (``<run>/checkpoints/<name>``)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))


def run_config(ckpt: str, name: str):
    """The Config of the run that wrote ``ckpt`` (its run folder's config.yaml)."""
    from megaforge.config import load_config

    path = os.path.join(run_dir_of(ckpt), "config.yaml")
    if not os.path.exists(path):
        raise SourceError(f"{name} {ckpt}: no config.yaml in its run folder {run_dir_of(ckpt)}")
    return load_config(["--config", path])


def checkpoint_to_hf(ckpt: str, run_cfg, out: str, name: str = "model.path") -> None:
    """The policy weights of run checkpoint ``ckpt`` (written by a run of ``run_cfg``) as an HF folder
    ``out`` (config, safetensors, tokenizer)."""
    from megaforge import checkpoint

    checkpoint.check_loadable(ckpt)
    trainer_dir = os.path.join(ckpt, "trainer")
    if run_cfg.trainer.backend == "megatron":
        cmd = [sys.executable, os.path.join(ROOT, "tools", "convert_megatron_to_hf.py"), "--ckpt", trainer_dir,
               "--out", out]
        if subprocess.run(cmd).returncode != 0:
            raise SourceError(f"{name}: converting {trainer_dir} to HF failed (command: {' '.join(cmd)})")
        return
    import torch

    from megaforge.hf import load_hf_model, load_tokenizer

    f = os.path.join(trainer_dir, "trainer.pt")
    state = torch.load(f, map_location="cpu", weights_only=True)
    model = load_hf_model(run_cfg.model, torch.device("cpu"))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise SourceError(f"{name}: {f}: the saved weights do not fit the run's model.*: {e}") from None
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(run_cfg.model).save_pretrained(out)


def export(path: str, out: str, name: str, log: Callable[[str], None] = lambda m: None) -> Optional[str]:
    """Run source ``path`` as an HF folder ``out`` (replaced if present); returns the checkpoint it came
    from, or None (nothing written) when ``path`` is an HF folder already. Errors as :func:`locate`."""
    ckpt = locate(path, name, log)
    if ckpt is None:
        return None
    cfg = run_config(ckpt, name)
    shutil.rmtree(out, ignore_errors=True)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    checkpoint_to_hf(ckpt, cfg, tmp, name)
    os.replace(tmp, out)
    return ckpt
