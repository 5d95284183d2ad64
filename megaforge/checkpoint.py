"""Run checkpoints: atomic, checksummed, resumable.

Layout: ``<run dir>/checkpoints/step_000012/`` (RL step 12; ``sft_step_000050/`` during the SFT warm
start, ordered before every RL checkpoint) holding ``trainer/`` (the backend's own files),
``state.json`` (loop state: phase, steps, data position, weight version), ``rng_rank{R}.pt`` and,
written last, ``manifest.json`` (sha256 and size of every file). A checkpoint is written under
``.tmp-step_000012`` and renamed when complete, so a crash never leaves a half checkpoint under a
real name. :func:`latest_valid` skips (and names) any checkpoint whose manifest is missing or whose
files do not match it, falling back to the previous one.

Loading is safe against a crafted checkpoint (a matching manifest proves integrity, not origin):
before the trainer reads anything, :func:`check_loadable` opens every ``*.pt`` file with
``torch.load(weights_only=True)`` (memory-mapped: the tensors are not read), so it holds tensors and
plain containers only, whichever backend reads it later (megatron-core's own ``torch.load`` calls
pass no ``weights_only``); unpickles every ``*.metadata`` file (torch.distributed.checkpoint's, which
torch reads with plain ``pickle.load``) with an allowlist of torch's checkpoint metadata classes;
and refuses to run when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` would turn those defaults off. A refused
file raises :class:`CheckpointRefused` naming it and the refused global; nothing in it is run.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import json
import os
import pickle
import random
import re
import shutil
from typing import Callable, Optional

import numpy as np
import torch

from megaforge import dist

_NAME = re.compile(r"^(sft_)?step_(\d+)$")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if rel != "manifest.json":
                out.append(rel)
    return sorted(out)


def write_manifest(root: str) -> None:
    manifest = {rel: {"sha256": _sha256(os.path.join(root, rel)), "bytes": os.path.getsize(os.path.join(root, rel))}
                for rel in _files(root)}
    tmp = os.path.join(root, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "manifest.json"))


def verify(root: str) -> Optional[str]:
    """None when ``root`` is a complete checkpoint, else the reason it is not."""
    mf = os.path.join(root, "manifest.json")
    if not os.path.exists(mf):
        return "no manifest.json (incomplete write)"
    try:
        with open(mf) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable manifest.json: {e}"
    for rel, info in manifest.items():
        p = os.path.join(root, rel)
        if not os.path.exists(p):
            return f"missing file {rel}"
        if os.path.getsize(p) != info["bytes"]:
            return f"{rel}: {os.path.getsize(p)} bytes, manifest says {info['bytes']}"
        if _sha256(p) != info["sha256"]:
            return f"{rel}: checksum mismatch"
    return None


def checkpoint_name(step: int, phase: str = "rl") -> str:
    return f"{'sft_' if phase == 'sft' else ''}step_{step:06d}"


def list_checkpoints(ckpt_dir: str) -> list[tuple[tuple[int, int], str]]:
    """Complete-or-not checkpoints, oldest first: SFT ones, then RL ones, by step."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        m = _NAME.match(name)
        if m:
            out.append(((0 if m.group(1) else 1, int(m.group(2))), os.path.join(ckpt_dir, name)))
    return sorted(out)


def latest_valid(ckpt_dir: str, log: Callable[[str], None] = print) -> Optional[str]:
    """Newest complete checkpoint; corrupt or partial ones are reported and skipped."""
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        why = verify(path)
        if why is None:
            return path
        log(f"[megaforge] checkpoint {path} is not usable ({why}); falling back to an earlier one")
    return None


def save(ckpt_dir: str, step: int, trainer, loop_state: dict, keep_last_n: int, phase: str = "rl") -> str:
    """Collective: every rank calls it. Returns the final checkpoint path."""
    name = checkpoint_name(step, phase)
    final = os.path.join(ckpt_dir, name)
    tmp = os.path.join(ckpt_dir, ".tmp-" + name)
    if dist.is_main():
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    trainer.save(os.path.join(tmp, "trainer"))
    torch.save(_rng_tensors(), os.path.join(tmp, f"rng_rank{dist.rank()}.pt"))
    dist.barrier()
    if dist.is_main():
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(loop_state, f, indent=1)
        write_manifest(tmp)
        old = None
        if os.path.exists(final):  # keep the old one until the new one has its name
            old = os.path.join(ckpt_dir, ".old-" + name)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        for _, old in list_checkpoints(ckpt_dir)[:-keep_last_n]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _rng_tensors() -> dict:
    """RNG states as tensors / plain lists so they load with ``weights_only=True``."""
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _restore_rng(state: dict) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointRefused(RuntimeError):
    """A checkpoint file holds pickled objects outside the allowlist (code, arbitrary classes)."""


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str",
                                           "bytes", "bytearray", "complex", "slice", "object")} | {
    ("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("copyreg", "__newobj__"),
    ("copyreg", "__newobj_ex__"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint metadata only: its dataclasses and enums, torch dtypes/layouts/sizes."""

    def find_class(self, module, name):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def check_loadable(path: str) -> None:
    """Refuse (:class:`CheckpointRefused`) a checkpoint whose pickles name anything but tensors, plain
    containers and checkpoint metadata; see the module docstring."""
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        raise CheckpointRefused("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch.load calls without weights_only "
                                f"(megatron-core's) would unpickle arbitrary objects from {path}; unset it to resume")
    for rel in _files(path):
        f = os.path.join(path, rel)
        try:
            if rel.endswith(".pt"):
                try:
                    torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:  # a file torch cannot memory-map (old format): read it whole
                    if "mmap" not in str(e):
                        raise
                    torch.load(f, map_location="cpu", weights_only=True)
            elif rel.endswith(".metadata"):
                with open(f, "rb") as fh:
                    _MetadataUnpickler(fh).load()
        except pickle.UnpicklingError as e:
            m = re.search(r"(?:Unsupported global: GLOBAL |global )(\S+)", str(e))
            what = f"global {m.group(1)}" if m else str(e).strip().splitlines()[0]
            raise CheckpointRefused(f"checkpoint file {f} was refused: its pickle names {what}, which is not a "
                                    f"tensor, a plain container or checkpoint metadata (weights_only=True); it was "
                                    f"not loaded and nothing in it ran") from None


def load(path: str, trainer) -> dict:
    """Collective: restore the trainer and this rank's RNG; returns the loop state."""
    check_loadable(path)
    trainer.load(os.path.join(path, "trainer"))
    rng_file = os.path.join(path, f"rng_rank{dist.rank()}.pt")
    if os.path.exists(rng_file):
        _restore_rng(torch.load(rng_file, weights_only=True))
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)
