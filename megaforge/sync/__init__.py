"""Trainer -> engine weight transport.

:func:`push_weights` is the collective every trainer rank calls: all ranks drive the trainer's HF
bucket iterator (gathering TP shards / PP stages is collective), and the feeding rank hands each
bucket to the engine, which loads it and then serves version ``version``.
"""
from __future__ import annotations

from typing import Optional

import torch


class WeightMismatchError(RuntimeError):
    pass


def push_weights(trainer, engine, max_bytes: int, version: int, check_equal: bool = False) -> dict:
    """Stream the trainer's weights into ``engine`` (None on ranks without one). Returns stats."""
    stats = {"buckets": 0, "bytes": 0, "tensors": 0}
    checked: dict[str, torch.Tensor] = {}

    def buckets():
        for bucket in trainer.iter_hf_buckets(max_bytes):
            if not bucket:
                continue
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            if len(bucket) > 1 and size > max_bytes:
                raise ValueError(f"trainer produced a weight bucket of {size} bytes > limit {max_bytes}")
            stats["buckets"] += 1
            stats["bytes"] += size
            stats["tensors"] += len(bucket)
            if check_equal:
                for n, t in bucket:
                    checked[n] = t.detach().to("cpu", copy=True)
            yield bucket

    if engine is None:
        for _ in buckets():  # collective participation; nothing to deliver on this rank
            pass
        return stats
    engine.update_weights(buckets(), version)
    if engine.weight_version != version:
        raise WeightMismatchError(f"engine reports weight version {engine.weight_version} after update to {version}")
    if check_equal:
        compare_weights(checked, engine.named_weights())
    return stats


def compare_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    """Fail loudly, naming the first differing tensor, when the engine's weights are not the trainer's."""
    for name, t in expected.items():
        if name not in actual:
            raise WeightMismatchError(f"sync.check_equal: engine has no tensor {name!r}")
        a = actual[name].detach().to("cpu", t.dtype)
        if a.shape != t.shape:
            raise WeightMismatchError(f"sync.check_equal: {name!r} shape {tuple(a.shape)} on the engine, "
                                      f"{tuple(t.shape)} on the trainer")
        diff = (a.float() - t.float()).abs().max().item() if t.numel() else 0.0
        if diff > atol:
            raise WeightMismatchError(f"sync.check_equal: {name!r} differs by {diff:.3g} after the update")
