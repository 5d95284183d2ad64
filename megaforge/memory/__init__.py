"""Offload / onload of trainer state and the device-memory bookkeeping of the colocated step.

The colocated RL step (DESIGN.md "One RL step, colocated"; :mod:`megaforge.loop`), with the memory
each transition frees or takes on one GPU:

    rollout      engine: weights + KV cache + graphs      trainer: nothing on the device
    release      engine.release_memory(weights, kv_cache)
    onload       trainer.onload()          weights + state back       time/onload
    train        reference/old logprobs, loss, optimizer step          time/train
    offload      trainer.offload(["state"]) optimizer, grads, ref out  time/offload
    resume       engine.resume_memory(weights)
    sync         push_weights: trainer weights -> engine (CUDA IPC)    time/sync
    offload      trainer.offload(["weights"]); release_cached()        time/offload
    resume       engine.resume_memory(kv_cache, cuda_graph)

``memory.offload``: ``pinned`` (:class:`~megaforge.memory.offload.PinnedOffloader`: host buffers
allocated once, chunked, side-stream copies), ``tms`` (:class:`~megaforge.memory.tms.TmsOffloader`:
torch_memory_saver pause/resume), ``none`` (state stays resident). On a CPU trainer ``pinned`` and
``tms`` are a documented no-op: the state already lives in host memory (the copy engine itself runs
on CPU in tests, with ``PinnedOffloader(..., device="cpu")``).

NCCL communicators. torch (2.11 on the GPU machine, 2.13 here) gives no way to release a live
communicator's memory and keep the group: ``ProcessGroupNCCL.abort()`` / ``_abort_process_group``
end the group for good (megatron's parallel state holds dozens of groups, re-creating them is a
re-initialisation), ``shrink_group`` builds a smaller new group, and NCCL's own
``ncclCommSuspend``/``ncclCommResume`` (NCCL >= 2.29) are not reachable from torch's Python API (no
communicator handle). Communicators are created lazily (at a group's first collective), so a
1-GPU colocated run has none in the trainer; with several ranks their buffers are bounded by
``NCCL_BUFFSIZE`` (default 4 MiB per channel and peer) and ``NCCL_NCHANNELS_PER_NET_PEER``.
What megaforge does: measure, every step, the device memory held outside torch's allocator by this
process (``memory/outside_torch_gib`` = used by the process's context, communicators, cuBLAS
workspaces: ``device used - torch reserved`` with no other process on the GPU), release torch's own
cache and finished CUDA-IPC blocks before the engine takes memory back (:func:`release_cached`),
and destroy megaforge's weight-update group only at shutdown (one communicator, measured by
tools/bench/bench_colocate.py).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Optional, Sequence

import torch

from megaforge.memory.offload import TAGS, Entry, PinnedOffloader  # noqa: F401
from megaforge.memory.tms import TmsOffloader

log = logging.getLogger(__name__)
OFFLOAD_MODES = ("none", "pinned", "tms")
GIB = float(1 << 30)


def build_offloader(mode: str, device, entries_fn: Callable[[Sequence[str]], list], chunk_bytes: int = 1 << 30):
    """The offloader of ``memory.offload`` for a trainer on ``device`` (None: nothing to do)."""
    if mode == "auto":
        raise ValueError("memory.offload 'auto' is decided by megaforge.build.RunBuilder.resolve_offload before a "
                         "trainer is built (RunBuilder.trainer does it); a trainer built otherwise needs none, pinned "
                         "or tms")
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"memory.offload {mode!r}: valid: {', '.join(OFFLOAD_MODES)}")
    device = torch.device(device)
    if mode == "none":
        return None
    if device.type != "cuda":
        log.info("memory.offload %s: the trainer runs on %s, its state already lives in host memory; offload and "
                 "onload do nothing", mode, device.type)
        return None
    if mode == "pinned":
        return PinnedOffloader(entries_fn, device, chunk_bytes=chunk_bytes)
    return TmsOffloader(entries_fn, device)


@contextlib.contextmanager
def resident(offloader):
    """Everything onloaded inside (checkpoint save/load, HF export), the same tags offloaded after."""
    tags = list(offloader.offloaded_tags) if offloader is not None else []
    if tags:
        offloader.onload(tags)
    try:
        yield
    finally:
        if tags:
            offloader.offload(tags)


def release_cached(device=None) -> None:
    """Blocks this process shared over CUDA IPC and now released by their consumer are freed, then
    torch's cache goes back to the driver (before an engine process allocates its KV cache)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def _cuda_device(device=None) -> Optional[torch.device]:
    if device is not None:
        device = torch.device(device)
        return device if device.type == "cuda" else None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def outside_torch_gib(device=None) -> Optional[float]:
    """GiB of the device in use but not reserved by torch's allocator in this process (CUDA
    context, NCCL communicators, library workspaces; other processes' memory too when the GPU is
    shared, so it is measured with the engine's memory released). None without CUDA."""
    dev = _cuda_device(device)
    if dev is None:
        return None
    free, total = torch.cuda.mem_get_info(dev)
    return (total - free - torch.cuda.memory_reserved(dev)) / GIB


@contextlib.contextmanager
def phase(metrics: dict, name: str, device=None):
    """``memory/peak_gib/<name>``: the peak of torch-allocated device memory of this process during
    the block (peak statistics reset at its start). Nothing is recorded without CUDA."""
    dev = _cuda_device(device)
    if dev is not None:
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        yield
    finally:
        if dev is not None:
            peak = torch.cuda.max_memory_allocated(dev) / GIB
            key = f"memory/peak_gib/{name}"
            metrics[key] = max(metrics.get(key, 0.0), peak)


def onloaded(method):
    """Decorator of trainer methods that read or replace the whole state (save, load, HF export,
    reference snapshot): run them with everything onloaded (``self._mem``, the trainer's offloader)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with resident(getattr(self, "_mem", None)):
            return method(self, *args, **kwargs)

    return wrapper
