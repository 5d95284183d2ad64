"""``memory.offload: tms``: trainer state paused and resumed by torch_memory_saver.

torch_memory_saver (``pip install torch-memory-saver``; imported lazily, only in this mode) owns a
memory pool whose allocations can be *paused*: the physical memory is copied to a CPU backup and
unmapped while the virtual addresses stay reserved, so every tensor and view stays valid, and
*resumed*: remapped and copied back. Hook mode ``torch`` (a pluggable allocator inside a
``torch.cuda.MemPool``; no ``LD_PRELOAD`` needed).

Tensors must be allocated inside the pool. The trainer's tensors exist before this mode starts, so
each tag is *migrated* once: its first offload goes through :class:`PinnedOffloader` (copy to host,
free), and the following onload allocates the device storage inside
``torch_memory_saver.region("megaforge_<tag>", enable_cpu_backup=True)`` and drops the host
buffers of that pass. From then on ``offload(tag)`` = ``pause("megaforge_<tag>")`` and
``onload(tag)`` = ``resume(...)``. A tag whose tensors changed (a new optimizer: another signature)
is migrated again.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence

import torch

from megaforge.memory.offload import TAGS, PinnedOffloader, entries_signature

INSTALL_HINT = "pip install torch-memory-saver"


def load_tms(hook_mode: str = "torch"):
    """The torch_memory_saver singleton, configured for ``hook_mode``; a clear ImportError naming the
    package when it is missing."""
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError as e:
        raise ImportError(f"memory.offload: tms needs the torch_memory_saver package ({INSTALL_HINT}), which is not "
                          f"importable here ({e}); or set memory.offload: pinned") from e
    try:
        torch_memory_saver.hook_mode = hook_mode
    except (AssertionError, AttributeError, TypeError):  # already initialised by an earlier user: keep it
        pass
    return torch_memory_saver


class TmsOffloader:
    """Same interface as :class:`PinnedOffloader` (offload/onload by tag, ``offloaded_tags``, ``last``)."""

    def __init__(self, entries_fn: Callable[[Sequence[str]], list], device, hook_mode: str = "torch"):
        self.tms = load_tms(hook_mode)
        self.entries_fn = entries_fn
        self.pinned = PinnedOffloader(entries_fn, device)
        self.device = self.pinned.device
        self.managed: dict[str, tuple] = {}  # tag -> signature of its tensors when they entered the pool
        self.paused: set[str] = set()
        self.stats = {"migrations": 0}
        self.last: dict = {}

    @staticmethod
    def tms_tag(tag: str) -> str:
        return f"megaforge_{tag}"

    def _bytes(self, tag: str) -> int:
        seen, n = set(), 0
        for e in self.entries_fn([tag]):
            st = e.tensor.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                n += st.nbytes()
        return n

    def offload(self, tags: Optional[Iterable[str]] = None) -> dict:
        t0, nbytes, done = time.perf_counter(), 0, []
        for tag in tags or TAGS:
            if tag in self.paused or self.pinned.offloaded(tag):
                continue
            if self.managed.get(tag) == entries_signature(list(self.entries_fn([tag]))):
                nbytes += self._bytes(tag)
                torch.cuda.synchronize(self.device)
                self.tms.pause(self.tms_tag(tag))
                self.paused.add(tag)
            else:  # not (or no longer) in the pool: through pinned host buffers, back into the pool on onload
                self.managed.pop(tag, None)
                nbytes += self.pinned.offload([tag])["bytes"]
            done.append(tag)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.last = {"op": "offload", "tags": done, "bytes": nbytes, "seconds": time.perf_counter() - t0}
        return self.last

    def onload(self, tags: Optional[Iterable[str]] = None) -> dict:
        t0, nbytes, done = time.perf_counter(), 0, []
        for tag in tags or TAGS:
            if tag in self.paused:
                self.tms.resume(self.tms_tag(tag))
                self.paused.discard(tag)
                nbytes += self._bytes(tag)
            elif self.pinned.offloaded(tag):
                region = lambda tag=tag: self.tms.region(tag=self.tms_tag(tag), enable_cpu_backup=True)  # noqa: E731
                nbytes += self.pinned.onload([tag], alloc_ctx=region)["bytes"]
                self.managed[tag] = entries_signature(list(self.entries_fn([tag])))
                self.pinned.drop(tag)  # the pool keeps its own CPU backup from now on
                self.stats["migrations"] += 1
            else:
                continue
            done.append(tag)
        self.last = {"op": "onload", "tags": done, "bytes": nbytes, "seconds": time.perf_counter() - t0}
        return self.last

    def offloaded(self, tag: str) -> bool:
        return tag in self.paused or self.pinned.offloaded(tag)

    @property
    def offloaded_tags(self) -> list[str]:
        return [t for t in TAGS if self.offloaded(t)]
