"""LoRA adapters alone to an in-process engine (``sync.lora_adapters``): the engine merges them itself.

The trainer sends, per adapted linear ``M`` (HF module name), ``M.lora_A.weight`` A [r, in] and
``M.lora_B.weight`` B [out, r] in one bucket; the engine keeps its own copy of the base weight W0 of
``M.weight`` (taken at its first adapter update, when it still holds the base) and sets

    M.weight = merge_lora(W0, A, B, s) = (W0_f32 + s * (B_f32 @ A_f32)).to(W0.dtype)      s = alpha / rank

:func:`merge_lora` is also what the trainer's merged sync computes, so both ways give the engine the
same tensors bit for bit (same dtype). Bytes per adapted linear: r (in + out) instead of in x out
(the frozen base never moves); the engine holds a second copy of the adapted base weights.
"""
from __future__ import annotations

import os
import tempfile

import torch

from megaforge.engine_kinds import engine_kind

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A for W [out, in], A [r, in], B [out, r]: float32 sum, cast to W's dtype."""
    return (weight.detach().float() + scale * (b.detach().float() @ a.detach().float())).to(weight.dtype)


def byte_buckets(groups, max_bytes: int):
    """Buckets ``[(name, tensor), ...]`` of at most ``max_bytes`` from ``groups`` (iterables of lists of
    ``(name, tensor)``, in order): a group is never split, and a group larger than ``max_bytes`` is a
    bucket of its own."""
    bucket, size = [], 0
    for group in groups:
        nbytes = sum(t.numel() * t.element_size() for _, t in group)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += group
        size += nbytes
    if bucket:
        yield bucket


def pair_buckets(pairs, max_bytes: int):
    """``[(M.lora_A.weight, A), (M.lora_B.weight, B), ...]`` buckets of at most ``max_bytes`` (an A/B
    pair is never split; a pair larger than that is a bucket of its own) from ``(M, A, B)``."""
    return byte_buckets(([(mod + LORA_A, a), (mod + LORA_B, b)] for mod, a, b in pairs), max_bytes)


def adapter_pairs(buckets):
    """(module name, A, B) from buckets of ``(name, tensor)`` holding ``M.lora_A.weight`` and
    ``M.lora_B.weight`` (a pair may span buckets); a name of another form, or a pair left incomplete,
    is a ValueError."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for bucket in buckets:
        for name, t in bucket:
            for suffix in (LORA_A, LORA_B):
                if name.endswith(suffix):
                    mod = name[: -len(suffix)]
                    pending.setdefault(mod, {})[suffix] = t
                    if len(pending[mod]) == 2:
                        got = pending.pop(mod)
                        yield mod, got[LORA_A], got[LORA_B]
                    break
            else:
                raise ValueError(f"adapter sync: {name!r} is not a LoRA tensor (*{LORA_A} / *{LORA_B})")
    if pending:
        raise ValueError(f"adapter sync: incomplete A/B pairs for {sorted(pending)[:3]}")


def push_adapters(trainer, engine, max_bytes: int, version: int) -> dict:
    """:func:`megaforge.sync.push_weights` for the adapters alone, on every trainer rank. An engine kind
    that takes ``tensors`` (megaforge.engine_kinds): ``trainer.iter_adapter_buckets`` into
    ``engine.update_adapters`` (scale ``trainer.lora.scale``); one that takes a ``folder``
    (:func:`push_adapter_folder`). Returns ``buckets``, ``bytes``, ``tensors``."""
    if engine_kind(trainer.cfg.rollout.engine).lora_adapters == "folder":
        return push_adapter_folder(trainer, engine, version)
    stats = {"buckets": 0, "bytes": 0, "tensors": 0}

    def buckets():
        for bucket in trainer.iter_adapter_buckets(max_bytes):
            if bucket:
                stats["buckets"] += 1
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
                stats["tensors"] += len(bucket)
                yield bucket

    if engine is None:
        for _ in buckets():
            pass
        return stats
    engine.update_adapters(buckets(), version, trainer.lora.scale)
    return stats


def push_adapter_folder(trainer, engine, version: int) -> dict:
    """The trainer writes version ``version``'s PEFT adapter folder (``trainer.export_adapter``, the
    writer of ``<run>/adapter/``: collective, the main rank writes) to ``engine.adapter_path(version)``
    and the engine loads it (``engine.load_adapter(path, version)``, megaforge.rollout.http.lora).
    ``bytes``: the folder's size (adapter_model.safetensors + adapter_config.json) on the main rank
    (0 elsewhere), ``tensors`` its tensor count; no engine: the folder goes to a temporary folder,
    counted and deleted."""
    with tempfile.TemporaryDirectory(prefix="megaforge-adapter-") as tmp:
        path = engine.adapter_path(version) if engine is not None else os.path.join(tmp, f"v{version}")
        trainer.export_adapter(path)
        stats = {"buckets": 0, "bytes": 0, "tensors": 0}
        if os.path.isdir(path):
            stats["buckets"] = 1
            stats["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            stats["tensors"] = _tensor_count(os.path.join(path, "adapter_model.safetensors"))
            if engine is not None:
                engine.load_adapter(path, version)
    return stats


def _tensor_count(f: str) -> int:
    if not os.path.exists(f):
        return 0
    from safetensors import safe_open

    with safe_open(f, "pt") as h:
        return len(list(h.keys()))
