"""Double-buffered flat buckets for ``sync.transport: ipc`` (and any transport that hands a device
buffer to an engine and must not overwrite it early).

:class:`BucketBuffers` owns ``count`` (2) flat uint8 device buffers. Bucket ``k`` is flattened into
buffer ``k % count`` in SGLang's ``flattened_bucket`` layout (:func:`megaforge.sync.wire.flat_layout`:
tensors by element size, largest first, byte ranges back to back), handed to the engines, and its
*confirmation* (a callable that returns once every engine answered the load of bucket ``k``) is
registered with :meth:`sent`. Invariant: a buffer is written again only after the confirmation of
the bucket it carried returned, so with two buffers bucket ``k + 1`` is gathered while the engines
load bucket ``k`` and nothing an engine may still read is ever overwritten. (The engine answers only
after its copies finished: the embedded server synchronises its device before answering.)

A buffer grows when a bucket is larger (a single tensor above ``sync.bucket_mb`` is a bucket of its
own) and is freed by :meth:`close` at the end of the update, so no memory stays with the trainer
during the rollout. ``stats``: ``allocs`` (device allocations), ``waits`` (confirmations awaited
before a reuse), ``buckets``, ``bytes``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megaforge.sync import wire


class BucketBuffers:
    def __init__(self, device, count: int = 2):
        if count < 1:
            raise ValueError("BucketBuffers: count must be >= 1")
        self.device = torch.device(device)
        self.bufs: list[Optional[torch.Tensor]] = [None] * count
        self.pending: list[Optional[Callable[[], None]]] = [None] * count
        self.k = 0
        self.stats = {"allocs": 0, "waits": 0, "buckets": 0, "bytes": 0}

    def _wait(self, slot: int) -> None:
        done, self.pending[slot] = self.pending[slot], None
        if done is not None:
            self.stats["waits"] += 1
            done()

    def flatten(self, named) -> tuple[torch.Tensor, list, int]:
        """(flat uint8 view, metadata, slot) of bucket ``named`` in the next free buffer."""
        named = wire.packing_order(named)
        if not named:
            raise ValueError("flattened bucket: no tensors")
        metas, total = wire.flat_layout(named)
        slot = self.k % len(self.bufs)
        self.k += 1
        self._wait(slot)  # the bucket this buffer carried is loaded: it may be overwritten
        buf = self.bufs[slot]
        if buf is None or buf.numel() < total:
            self.bufs[slot] = None  # the old buffer is released before the larger one is taken
            buf = self.bufs[slot] = torch.empty(total, dtype=torch.uint8, device=self.device)
            self.stats["allocs"] += 1
        flat = buf[:total]
        for (name, t), m in zip(named, metas):
            if t.device != self.device:
                raise ValueError(f"flattened bucket: {name!r} is on {t.device}, the buffers on {self.device}")
            flat[m.start_idx:m.end_idx].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        self.stats["buckets"] += 1
        self.stats["bytes"] += total
        return flat, metas, slot

    def sent(self, slot: int, confirmation: Callable[[], None]) -> None:
        """Register the confirmation of the bucket in ``slot`` (awaited before the slot is reused)."""
        if self.pending[slot] is not None:
            raise RuntimeError(f"bucket buffer {slot} is sent twice without a confirmation in between")
        self.pending[slot] = confirmation

    def drain(self) -> None:
        """Await every outstanding confirmation (in sending order)."""
        order = [(self.k - 1 - i) % len(self.bufs) for i in range(len(self.bufs))][::-1]
        for slot in order:
            self._wait(slot)

    def close(self) -> None:
        """Drain, then free the buffers (the caller releases torch's cache afterwards)."""
        try:
            self.drain()
        finally:
            self.bufs = [None] * len(self.bufs)
            self.pending = [None] * len(self.bufs)
