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

import torch

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A for W [out, in], A [r, in], B [out, r]: float32 sum, cast to W's dtype."""
    return (weight.detach().float() + scale * (b.detach().float() @ a.detach().float())).to(weight.dtype)


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
    """:func:`megaforge.sync.push_weights` for the adapters alone: ``trainer.iter_adapter_buckets``
    into ``engine.update_adapters`` (scale ``trainer.lora.scale``). Returns ``buckets``, ``bytes``,
    ``tensors``."""
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
