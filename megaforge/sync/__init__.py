"""Trainer -> engine weight transport.

:func:`push_weights` is the collective every trainer rank calls: all ranks drive the trainer's HF
bucket iterator (gathering TP shards / PP stages is collective), and the feeding rank hands each
bucket to the engine, which loads it and then serves version ``version``.

Transports (``sync.transport``; :mod:`megaforge.sync.transports` for HTTP engines, over the
engine's fan-out of servers): ``ipc`` (colocated: CUDA buckets flattened into one of two reused device buffers
(:class:`~megaforge.sync.buffers.BucketBuffers`), shared by CUDA IPC in SGLang's
``flattened_bucket`` format, a buffer reused only after the engine confirmed its load, generation
paused and the cache flushed around the update); ``shm`` (CPU buffers in shared memory); ``nccl``
(separate GPUs: one broadcast per bucket in a weight-update group while the HTTP call announces
names, dtypes and shapes); ``disk`` (safetensors shards, then ``/update_weights_from_disk``);
``auto`` (ipc for CUDA tensors, shm for CPU ones). The in-process embedded engine loads the
trainer's tensors directly.

Bucket bound: every bucket holds at most ``max_bytes`` bytes, except a single tensor larger than
that, which is a bucket of its own; a trainer producing anything else fails the sync.

``check_equal``: the engine's tensors are compared with the trainer's after the update
(:mod:`megaforge.sync.check`), for in-process and HTTP engines.
"""
from __future__ import annotations

from megaforge.sync.check import WeightMismatchError, check_engine_weights, make_check, tensor_digest  # noqa: F401


def push_weights(trainer, engine, max_bytes: int, version: int, check_equal: bool = False) -> dict:
    """Stream the trainer's weights into ``engine`` (None on ranks without one). Returns stats:
    ``buckets``, ``bytes``, ``tensors``, ``max_bucket_bytes`` (and ``checked`` with check_equal)."""
    stats = {"buckets": 0, "bytes": 0, "tensors": 0, "max_bucket_bytes": 0}
    check = make_check(engine) if check_equal else None

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
            stats["max_bucket_bytes"] = max(stats["max_bucket_bytes"], size)
            if check is not None:
                for n, t in bucket:
                    check.record(n, t)
            yield bucket

    if engine is None:
        for _ in buckets():  # collective participation; nothing to deliver on this rank
            pass
        return stats
    engine.update_weights(buckets(), version)
    if engine.weight_version != version:
        raise WeightMismatchError(f"engine reports weight version {engine.weight_version} after update to {version}")
    if check is not None:
        stats["checked"] = check.verify()
    return stats
