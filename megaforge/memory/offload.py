"""Trainer state to pinned host buffers and back, without changing any tensor's identity.

:class:`PinnedOffloader` moves *entries* (tensors, each with a tag such as ``weights`` / ``state``)
between the device and host buffers that are allocated once per tag and reused every step.

Slots. Entries are grouped by storage (``untyped_storage()``). A storage is a *movable* slot when
exactly one given tensor references it, covers it whole (contiguous, offset 0,
``numel * itemsize == nbytes``) and the entry allows it (``movable=True``); every other storage is a
*fixed* slot: it is freed and re-allocated in place (``storage.resize_``), so every view of it
stays valid (megatron DDP's contiguous param/grad buffers, whose views are the parameters).

Chunks. Movable slots are packed into chunks of at most ``chunk_bytes`` (a larger slot is a chunk
of its own), at offsets aligned to ``ALIGN`` bytes; a fixed slot is a chunk by itself. On the first
onload after a plan, each chunk is allocated as one device buffer and its tensors are re-pointed
into it (``t.data = chunk[off:off + n].view(dtype).view(shape)``): from then on one copy and one
allocation per chunk, whatever the number of tensors.

Invariants (tested on CPU with ``device="cpu"`` host buffers, on GPU by tools/bench/bench_colocate.py):
* identity: no tensor object is replaced; parameters, optimizer-state tensors and views keep
  their ``id``; only ``.data`` of movable tensors is re-pointed (same shape, dtype, contiguous).
* values: after ``onload(tag)`` every ``keep=True`` tensor holds the bytes it held before
  ``offload(tag)``; ``keep=False`` tensors (gradient buffers, zero between steps) read zero.
* memory: after ``offload(tag)`` every storage of the tag has size 0 (freed only after the copy's
  event completed); host bytes of a tag = sum over keep chunks of their sizes, carved from the tag's
  host *region* (one pinned allocation per tag, reused by every later plan that fits in it, e.g.
  after the optimizer created its state) and reused while its signature (tensor ids, shapes, dtypes,
  storage pointers as left by the last onload) is unchanged; ``stats["host_allocs"]`` counts host
  allocations. :meth:`PinnedOffloader.reserve` pins the regions ahead of the first offload on a
  background thread (pinning tens of GiB takes seconds: the loop starts it while the engines start).
  Regions are page-locked with ``cudaHostRegister`` (exact sizes; torch's pinned allocator rounds
  every block up to a power of two).
* copies run on a side stream (CUDA): it waits for the current stream, records an event, and the
  host waits for that event before a storage is freed (offload) or the call returns (onload), so
  ``time/offload`` and ``time/onload`` measure finished copies.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch

ALIGN = 512  # bytes: every dtype's views stay aligned; the CUDA caching allocator's granularity
TAGS = ("weights", "state")
log = logging.getLogger(__name__)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def pinned_host_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor of exactly ``nbytes``, page-locked when ``pin`` (cudaHostRegister of a plain
    allocation; torch's pinned allocator as the fallback when registration is refused, logged)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if not pin or nbytes == 0:
        return t
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
    except (RuntimeError, AttributeError, TypeError) as e:
        err = f"{type(e).__name__}: {e}"
    if err != 0:
        log.warning("cudaHostRegister of %.2f GiB failed (%s); using torch's pinned allocator for it", nbytes / 2**30, err)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t._megaforge_registered = True  # unregistered by PinnedOffloader.close / region replacement
    return t


def _unpin(t: Optional[torch.Tensor]) -> None:
    if t is not None and getattr(t, "_megaforge_registered", False):
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        t._megaforge_registered = False


@dataclass
class Entry:
    """One tensor to offload. ``keep``: its values survive (False: zero after onload). ``movable``:
    it may be re-pointed into a chunk (False when other, unlisted tensors view its storage)."""

    tensor: torch.Tensor
    tag: str = "state"
    keep: bool = True
    movable: bool = True


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    tensor: Optional[torch.Tensor]  # the one tensor of a movable slot
    nbytes: int
    keep: bool
    offset: int = 0  # in its chunk


@dataclass
class _Chunk:
    slots: list
    nbytes: int
    keep: bool
    fixed: bool  # a foreign storage resized in place
    host: Optional[torch.Tensor] = None
    device_buf: Optional[torch.Tensor] = None  # uint8 over the chunk's device storage, once coalesced
    coalesced: bool = False

    def device_storage(self) -> torch.UntypedStorage:
        return self.slots[0].storage if self.fixed else self.device_buf.untyped_storage()


@dataclass
class _Plan:
    chunks: list
    signature: tuple
    offloaded: bool = False
    bytes: int = 0  # bytes copied per offload (keep chunks)
    tensors: list = field(default_factory=list)


def entries_signature(entries: Sequence[Entry]) -> tuple:
    out = []
    for e in entries:
        t = e.tensor
        out.append((id(t), tuple(t.shape), t.dtype, e.keep, e.movable, t.untyped_storage().data_ptr(),
                    t.storage_offset()))
    return tuple(out)


class PinnedOffloader:
    """Offload / onload of tagged trainer tensors; see the module docstring for the invariants.

    ``entries_fn(tags)`` returns the current entries of those tags (re-read at every offload, so an
    optimizer created lazily or anew is picked up). ``device``: the accelerator (``cpu`` emulates
    it: host buffers are plain CPU tensors and copies synchronous; the tests' mode)."""

    def __init__(self, entries_fn: Callable[[Sequence[str]], list], device, chunk_bytes: int = 1 << 30,
                 pin: Optional[bool] = None):
        self.entries_fn = entries_fn
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": this process's current GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.pin = self.cuda if pin is None else pin
        self.chunk_bytes = int(chunk_bytes)
        self.plans: dict[str, _Plan] = {}
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = {"host_allocs": 0, "host_bytes": 0, "plans": 0}
        self.last: dict = {}
        self._regions: dict[str, torch.Tensor] = {}  # tag -> its host region (plans carve chunks from it)
        self._reserving: Optional[threading.Thread] = None
        self._reserve_error: Optional[BaseException] = None

    # ------------------------------------------------------------------------------ host regions
    def reserve(self, nbytes_by_tag: dict) -> None:
        """Pin each tag's host region (``{tag: bytes}``) on a background thread, so the first offload
        only copies; a plan that needs more than its region allocates a bigger one then."""
        def work():
            try:
                for tag, n in nbytes_by_tag.items():
                    if n > 0 and (tag not in self._regions or self._regions[tag].numel() < n):
                        self._set_region(tag, pinned_host_bytes(int(n), self.pin))
            except BaseException as e:  # noqa: BLE001  (raised by the plan that waits for it)
                self._reserve_error = e
        self._wait_reserved()
        self._reserving = threading.Thread(target=work, name="megaforge-pin-host", daemon=True)
        self._reserving.start()

    def _wait_reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._reserve_error is not None:
            err, self._reserve_error = self._reserve_error, None
            raise RuntimeError(f"pinning the offload's host buffers failed: {err}") from err

    def _set_region(self, tag: str, t: torch.Tensor) -> None:
        _unpin(self._regions.get(tag))
        self._regions[tag] = t
        self.stats["host_allocs"] += 1

    def _region(self, tag: str, nbytes: int) -> torch.Tensor:
        self._wait_reserved()
        r = self._regions.get(tag)
        if r is None or r.numel() < nbytes:
            if r is not None:
                log.info("offload: %r needs %.2f GiB of host buffers, its region holds %.2f: re-pinning", tag,
                         nbytes / 2**30, r.numel() / 2**30)
            self._set_region(tag, pinned_host_bytes(nbytes, self.pin))
        return self._regions[tag]

    def close(self) -> None:
        """Unpin the host regions (the offloaded tensors' bytes are gone after this)."""
        self._wait_reserved()
        for t in self._regions.values():
            _unpin(t)
        self._regions.clear()
        self.plans.clear()

    # ------------------------------------------------------------------------------ planning
    def _plan(self, tag: str, entries: list) -> _Plan:
        by_storage: dict[int, list] = {}
        for e in entries:
            t = e.tensor
            if t.device != self.device:
                raise ValueError(f"offload: a {tag!r} tensor is on {t.device}, the offloader's device is {self.device}")
            st = t.untyped_storage()
            if st.nbytes() == 0:
                continue
            by_storage.setdefault(st._cdata, []).append(e)
        movable, chunks = [], []
        for group in by_storage.values():
            uniq = list({id(e.tensor): e for e in group}.values())
            t = uniq[0].tensor
            st = t.untyped_storage()
            keep = any(e.keep for e in group)
            whole = (len(uniq) == 1 and uniq[0].movable and t.is_contiguous() and t.storage_offset() == 0
                     and t.numel() * t.element_size() == st.nbytes())
            if whole and not st.resizable():  # e.g. memory-mapped from a checkpoint (CPU): own a copy first
                t.data = t.detach().clone()
                st = t.untyped_storage()
            if whole:
                movable.append(_Slot(st, t, st.nbytes(), keep))
            elif not st.resizable():
                raise ValueError(f"offload: a {tag!r} storage of {st.nbytes()} bytes is not resizable and has views "
                                 f"(memory-mapped?); it cannot be freed in place")
            else:
                chunks.append(_Chunk([_Slot(st, None, st.nbytes(), keep)], st.nbytes(), keep, fixed=True,
                                     coalesced=True))
        for keep in (True, False):
            cur, size = [], 0
            for s in sorted((s for s in movable if s.keep == keep), key=lambda s: -s.nbytes):
                if cur and size + align_up(s.nbytes) > self.chunk_bytes:
                    chunks.append(_Chunk(cur, size, keep, fixed=False))
                    cur, size = [], 0
                s.offset = size
                cur.append(s)
                size += align_up(s.nbytes)
            if cur:
                chunks.append(_Chunk(cur, size, keep, fixed=False))
        plan = _Plan(chunks, entries_signature(entries), tensors=[e.tensor for e in entries])
        need = sum(align_up(c.nbytes) for c in chunks if c.keep)
        region, off = (self._region(tag, need) if need else None), 0
        for c in chunks:
            if c.keep:
                c.host = region[off:off + c.nbytes]
                off += align_up(c.nbytes)
                self.stats["host_bytes"] += c.nbytes
                plan.bytes += sum(s.nbytes for s in c.slots)
        self.stats["plans"] += 1
        return plan

    def drop(self, tag: str) -> None:
        old = self.plans.pop(tag, None)
        if old is not None:
            self.stats["host_bytes"] -= sum(c.nbytes for c in old.chunks if c.host is not None)

    # ------------------------------------------------------------------------------ copying
    def _copy_ctx(self):
        if self.stream is None:
            return _NullCtx()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _finish(self) -> None:
        if self.stream is not None:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            ev.synchronize()

    def offload(self, tags: Optional[Iterable[str]] = None) -> dict:
        """Copy the tags' tensors to their host buffers and free their device storage. Tags already
        offloaded are skipped. Returns {"bytes", "seconds"} of this call."""
        t0 = time.perf_counter()
        todo = [t for t in (tags or TAGS) if not (t in self.plans and self.plans[t].offloaded)]
        plans = []
        for tag in todo:
            entries = list(self.entries_fn([tag]))
            plan = self.plans.get(tag)
            if plan is None or plan.signature != entries_signature(entries):
                self.drop(tag)
                plan = self.plans[tag] = self._plan(tag, entries)
            plans.append(plan)
        nbytes = 0
        with self._copy_ctx():
            for plan in plans:
                for c in plan.chunks:
                    if not c.keep:
                        continue
                    if c.coalesced:
                        src = c.device_buf if not c.fixed else _storage_bytes(c.device_storage(), self.device)
                        c.host.copy_(src, non_blocking=True)
                    else:
                        for s in c.slots:
                            c.host[s.offset:s.offset + s.nbytes].copy_(_storage_bytes(s.storage, self.device),
                                                                      non_blocking=True)
                    nbytes += sum(s.nbytes for s in c.slots)
        self._finish()
        for plan in plans:
            for c in plan.chunks:
                if c.coalesced:
                    c.device_storage().resize_(0)
                else:
                    for s in c.slots:
                        s.storage.resize_(0)
            plan.offloaded = True
        if self.cuda:
            torch.cuda.empty_cache()  # back to the driver: the engine process allocates next
        self.last = {"op": "offload", "tags": todo, "bytes": nbytes, "seconds": time.perf_counter() - t0}
        return self.last

    def onload(self, tags: Optional[Iterable[str]] = None, alloc_ctx=None) -> dict:
        """Re-allocate the tags' device storage and copy the host buffers back (``keep=False``
        chunks are zeroed). ``alloc_ctx``: a factory of the context manager each device allocation runs
        in (the torch_memory_saver region of :mod:`megaforge.memory.tms`). Returns {"bytes", "seconds"}."""
        t0 = time.perf_counter()
        plans = [(tag, self.plans[tag]) for tag in (tags or TAGS) if tag in self.plans and self.plans[tag].offloaded]
        fresh, nbytes = [], 0
        for _, plan in plans:
            for c in plan.chunks:  # chunk k+1 is allocated while chunk k is copied
                with (alloc_ctx() if alloc_ctx is not None else _NullCtx()):
                    if c.coalesced:
                        c.device_storage().resize_(c.nbytes)
                    else:
                        c.device_buf = torch.empty(c.nbytes, dtype=torch.uint8, device=self.device)
                        fresh.append(c)
                with self._copy_ctx():  # (the copy stream waits for the allocation's stream)
                    dst = c.device_buf if not c.fixed else _storage_bytes(c.device_storage(), self.device)
                    if c.keep:
                        dst.copy_(c.host, non_blocking=True)
                        nbytes += sum(s.nbytes for s in c.slots)
                    else:
                        dst.zero_()
        self._finish()
        for c in fresh:
            for s in c.slots:
                t = s.tensor
                t.data = c.device_buf[s.offset:s.offset + s.nbytes].view(t.dtype).view(t.shape)
                s.storage = c.device_buf.untyped_storage()
            c.coalesced = True
        for tag, plan in plans:
            plan.offloaded = False
            plan.signature = entries_signature(list(self.entries_fn([tag])))
        self.last = {"op": "onload", "tags": [t for t, _ in plans], "bytes": nbytes, "seconds": time.perf_counter() - t0}
        return self.last

    # ------------------------------------------------------------------------------ queries
    def offloaded(self, tag: str) -> bool:
        return tag in self.plans and self.plans[tag].offloaded

    @property
    def offloaded_tags(self) -> list[str]:
        return [t for t in TAGS if self.offloaded(t)]

    def host_bytes(self, tag: Optional[str] = None) -> int:
        plans = [self.plans[tag]] if tag is not None else list(self.plans.values())
        return sum(c.nbytes for p in plans for c in p.chunks if c.host is not None)

    def chunks(self, tag: str) -> int:
        return len(self.plans[tag].chunks) if tag in self.plans else 0


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
