"""How the trainer's weight buckets reach HTTP engine servers: one class per ``sync.transport``.

A transport drives a :class:`Fanout`, the engine made of several servers
(:class:`megaforge.rollout.http.engine.HTTPEngine` implements it): one async SGLang client per
engine, the event loop they run on, the fault bookkeeping (which failure is a dead engine, at which
restart epoch) and the weight snapshot fault tolerance writes beside every update.

* :class:`TensorTransport` (``auto``), :class:`ShmTransport` (``shm``), :class:`IpcTransport`
  (``ipc``): ``/update_weights_from_tensor`` with ``load_format: "flattened_bucket"``
  (:mod:`megaforge.sync.wire`). ``shm`` copies every bucket into CPU shared memory, ``ipc`` sends
  CUDA buckets as CUDA IPC handles through two reused device buffers
  (:class:`megaforge.sync.buffers.BucketBuffers`, generation paused around the update), ``auto``
  does whichever fits the trainer's tensors. The next bucket is gathered while the engines load the
  current one.
* :class:`NcclTransport` (``nccl``): ``/init_weights_update_group`` once (this process is rank 0;
  backend nccl for CUDA tensors, gloo for CPU ones), then per bucket
  ``/update_weights_from_distributed`` plus one broadcast of the flat buffer. A restarted engine is
  re-synced over a group of its own (:meth:`NcclTransport.resync`).
* :class:`DiskTransport` (``disk``): safetensors shards in a folder (the snapshot's, with fault
  tolerance on) and ``/update_weights_from_disk``.

Tensor and distributed updates sit inside ``/begin_weight_update`` .. ``/end_weight_update`` on the
engines whose release needs that session (:meth:`Fanout.needs_session`). The last bucket carries
``weight_version = str(version)`` and ``flush_cache``. An engine that fails with a fault during a
tensor update is recorded in ``failed`` (engine -> (epoch, error)); the other engines and the
snapshot still get every bucket, and the caller recovers the failed ones afterwards.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import socket
import tempfile
import time
from typing import Callable, Iterable, Optional, Protocol, Sequence

import torch

from megaforge.net import connect_host, free_port
from megaforge.sync import weight_group, wire
from megaforge.sync.buffers import BucketBuffers

TRANSPORTS = ("auto", "shm", "ipc", "nccl", "disk")
log = logging.getLogger("megaforge.sync.transports")


class WeightTransportError(RuntimeError):
    """A weight-update group could not be formed, or an engine refused a distributed bucket."""


class Snapshot(Protocol):
    """The weight snapshot written beside an update (:class:`megaforge.rollout.http.snapshot.WeightSnapshot`)."""

    def add_flat(self, flat: torch.Tensor, metas) -> None: ...
    def add_named(self, named) -> None: ...
    def commit(self, wait: bool = True) -> Optional[str]: ...
    def buckets(self) -> Iterable[tuple[torch.Tensor, list]]: ...


class Fanout(Protocol):
    """What a transport needs of an engine made of several servers."""

    clients: Sequence  # one async SGLang client per engine (megaforge.rollout.http.client.SGLangClient)
    tp_sizes: Sequence[int]  # TP ranks of each engine
    timeout_s: float  # of one request
    snapshot: Optional[Snapshot]  # written beside every update (None: fault tolerance off)

    def submit(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the engine's event loop."""

    def epoch(self, k: int) -> int:
        """Restarts of engine ``k`` so far (a fault seen at an older epoch is already handled)."""

    def is_fault(self, k: int, exc: BaseException) -> bool:
        """Whether ``exc`` from engine ``k`` means a dead or hung engine (else it is raised)."""

    def guarded_all(self, fn) -> list:
        """``fn(client)`` on every engine; an engine that fails with a fault is recovered and asked again."""

    def needs_session(self, k: int) -> bool:
        """Whether engine ``k``'s updates need ``/begin_weight_update`` .. ``/end_weight_update``."""


async def _nothing() -> None:
    return None


async def _gather(coros, return_exceptions: bool = False):
    return await asyncio.gather(*coros, return_exceptions=return_exceptions)


def _lookahead(it: Iterable):
    """(item, is_last) pairs."""
    it = iter(it)
    try:
        cur = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield cur, False
        cur = nxt
    yield cur, True


def send_all(fan: Fanout, make, failed: dict) -> Callable[[], None]:
    """Submit ``make(k, client)`` to every engine not in ``failed``; returns ``wait()``, which waits,
    records the engines that failed with a fault in ``failed`` and raises any other error."""
    ks = [k for k in range(len(fan.clients)) if k not in failed]
    epochs = [fan.epoch(k) for k in ks]

    async def run():
        return await asyncio.gather(*(make(k, fan.clients[k]) for k in ks), return_exceptions=True)

    fut = fan.submit(run())

    def wait() -> None:
        for k, ep, r in zip(ks, epochs, fut.result()):
            if isinstance(r, BaseException):
                if not isinstance(r, Exception) or not fan.is_fault(k, r):
                    raise r
                failed[k] = (ep, r)
    return wait


class Transport:
    """One ``sync.transport`` over ``fan``."""

    name = ""

    def __init__(self, fan: Fanout):
        self.fan = fan

    def update(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, failed: dict) -> None:
        """Every bucket to every engine (and the snapshot); see the module docstring for ``failed``."""
        raise NotImplementedError

    def resync(self, k: int, version: int) -> bool:
        """Load the snapshot of ``version`` into restarted engine ``k`` through this transport; False
        when the engine should read the snapshot folder itself (``/update_weights_from_disk``)."""
        return False

    def engine_restarted(self, k: int) -> None:
        """Engine ``k`` came back as a fresh process (state it held for this transport is gone)."""

    def close(self) -> None:
        """Free what the transport holds (best effort: the servers stop next)."""


class _SessionTransport(Transport):
    """An update inside the engines' weight-update session, the snapshot committed after it."""

    def update(self, buckets, version: int, failed: dict) -> None:
        fan = self.fan
        fan.guarded_all(lambda c: c.begin_weight_update() if fan.needs_session(fan.clients.index(c)) else _nothing())
        try:
            self.send(buckets, version, failed)
        finally:
            send_all(fan, lambda k, c: c.end_weight_update() if fan.needs_session(k) else _nothing(), failed)()
        if fan.snapshot is not None:  # written in the background unless a failed engine needs it now
            fan.snapshot.commit(wait=bool(failed))

    def send(self, buckets, version: int, failed: dict) -> None:
        raise NotImplementedError


class TensorTransport(_SessionTransport):
    """``auto``: CUDA buckets by CUDA IPC, CPU buckets through shared memory (see the module docstring)."""

    name = "auto"

    def by_ipc(self, bucket) -> bool:
        """Whether ``bucket`` goes as CUDA IPC handles (else through CPU shared memory)."""
        return bucket[0][1].is_cuda

    def flatten_shared(self, bucket):
        """(flat CPU shared-memory buffer, metadata) of a bucket that does not go by IPC."""
        return wire.flatten(bucket)

    def send(self, buckets, version: int, failed: dict) -> None:
        """CUDA buckets go through two reused device buffers (a buffer is rewritten only after the
        engines confirmed the load of the bucket it carried), with generation paused around the
        update; CPU buckets through fresh shared-memory buffers."""
        fan = self.fan
        inflight: Optional[tuple] = None
        sent = False
        pool: Optional[BucketBuffers] = None
        try:
            for bucket, last in _lookahead(buckets):
                cuda = self.by_ipc(bucket)
                if cuda and pool is None:
                    send_all(fan, lambda k, c: c.pause_generation("abort"), failed)()
                    pool = BucketBuffers(bucket[0][1].device)
                if cuda:
                    flat, metas, slot = pool.flatten(bucket)
                else:
                    flat, metas = self.flatten_shared(bucket)
                fut = send_all(fan, lambda k, c, flat=flat, metas=metas, last=last: c.update_weights_from_tensor(
                    [wire.flattened_bucket_payload(flat, metas) for _ in range(fan.tp_sizes[k])],
                    load_format=wire.FLATTENED_BUCKET, flush_cache=last, weight_version=str(version) if last else None),
                    failed)
                if cuda:
                    pool.sent(slot, fut)
                if fan.snapshot is not None:  # written while the engines load the same bucket
                    fan.snapshot.add_flat(flat, metas)
                if inflight is not None:
                    inflight[0]()
                inflight = (fut, flat)  # the buffer stays alive until its request is answered
                sent = True
            if inflight is not None:
                inflight[0]()
            if not sent:
                send_all(fan, lambda k, c: c.update_weight_version(str(version)), failed)()
        finally:
            if pool is not None:
                try:
                    pool.close()
                finally:
                    send_all(fan, lambda k, c: c.continue_generation(), failed)()


class ShmTransport(TensorTransport):
    """``shm``: every bucket copied into CPU shared memory (CUDA tensors too)."""

    name = "shm"

    def by_ipc(self, bucket) -> bool:
        return False

    def flatten_shared(self, bucket):
        return wire.flatten(bucket, to_cpu=True)


class IpcTransport(TensorTransport):
    """``ipc``: CUDA buckets as CUDA IPC handles; CPU tensors are an error."""

    name = "ipc"

    def by_ipc(self, bucket) -> bool:
        if not bucket[0][1].is_cuda:
            raise ValueError("sync.transport 'ipc' needs CUDA tensors; the trainer's are on "
                             f"{bucket[0][1].device} (use 'shm' or 'auto')")
        return True


class NcclTransport(_SessionTransport):
    """``nccl``: one broadcast per bucket in a weight-update group of this process and the engines."""

    name = "nccl"

    def __init__(self, fan: Fanout, group_name: str = "megaforge_weight_update"):
        super().__init__(fan)
        self.group_name = group_name
        self.group = None  # the process group, once formed (dropped when an engine restarts)
        self.device: Optional[torch.device] = None  # where the group's buckets live

    def _wait(self, coro):
        return self.fan.submit(coro).result()

    def _address(self) -> str:
        """Where the engines reach this process's weight-update group store."""
        hosts = {c.url.split("//", 1)[1].rsplit(":", 1)[0] for c in self.fan.clients}
        local = all(connect_host(h.strip("[]")) in ("127.0.0.1", "::1", "localhost") for h in hosts)
        return "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())

    def _join(self, clients: list, offsets: list[int], world: int, name: str, device: torch.device):
        """A weight-update group of this process (rank 0) and ``clients`` (from ``offsets``)."""
        addr = self._address()
        port = free_port(addr)
        backend = "nccl" if device.type == "cuda" else "gloo"
        fut = self.fan.submit(_gather([c.init_weights_update_group(addr, port, off, world, name, backend)
                                       for c, off in zip(clients, offsets)]))
        try:
            pg = weight_group.init_custom_process_group(backend, addr, port, world, 0, name,
                                                        timeout_s=min(self.fan.timeout_s, 600.0))
        except Exception as e:
            try:
                fut.result(timeout=5.0)
                why = ""
            except Exception as fe:  # noqa: BLE001
                why = f"; an engine said: {fe}"
            raise WeightTransportError(f"weight-update group ({backend}, {addr}:{port}, world {world}) failed: "
                                       f"{e}{why}") from e
        fut.result()
        return pg

    def _ensure_group(self, device: torch.device) -> None:
        if self.group is not None:
            return
        tp = self.fan.tp_sizes
        offsets = [1 + sum(tp[:k]) for k in range(len(self.fan.clients))]
        self.group = self._join(list(self.fan.clients), offsets, 1 + sum(tp), self.group_name, device)
        self.device = device

    def _broadcast(self, clients: list, pg, name: str, flat: torch.Tensor, metas, version: int, last: bool) -> None:
        """``/update_weights_from_distributed`` to ``clients`` and one broadcast of ``flat`` in ``pg``."""
        import torch.distributed as dist

        fut = self.fan.submit(_gather([c.update_weights_from_distributed(
            [m.name for m in metas], [str(m.dtype).removeprefix("torch.") for m in metas],
            [list(m.shape) for m in metas], group_name=name, flush_cache=last,
            weight_version=str(version) if last else None, load_format=wire.FLATTENED_BUCKET) for c in clients]))
        work = dist.broadcast(flat, src=0, group=pg, async_op=True)
        while not work.is_completed():  # an engine that refuses the bucket never joins: fail, not hang
            if fut.done() and fut.exception() is not None:
                raise WeightTransportError(f"an engine refused a distributed weight bucket: {fut.exception()}")
            time.sleep(0.002)
        work.wait()
        fut.result()

    def send(self, buckets, version: int, failed: dict) -> None:
        snapshot = self.fan.snapshot
        for bucket, last in _lookahead(buckets):
            named = wire.packing_order(bucket)
            self._ensure_group(named[0][1].device)
            flat, metas = wire.flatten(named, shared=False)
            try:
                self._broadcast(list(self.fan.clients), self.group, self.group_name, flat, metas, version, last)
            except WeightTransportError:
                self.group = None
                raise
            if snapshot is not None:
                snapshot.add_flat(flat, metas)

    def resync(self, k: int, version: int) -> bool:
        """Over a weight-update group of engine ``k`` alone, once the run's group exists (the transport
        the run already uses, which also reaches an engine that cannot read this machine's disk)."""
        if self.device is None:
            return False
        fan = self.fan
        c, name = fan.clients[k], f"{self.group_name}-resync-{k}-{fan.epoch(k)}"
        t0 = time.perf_counter()
        pg = self._join([c], [1], 1 + fan.tp_sizes[k], name, self.device)
        try:
            nbytes = 0
            if fan.needs_session(k):
                self._wait(c.begin_weight_update())
            try:
                for (flat, metas), last in _lookahead(fan.snapshot.buckets()):
                    self._broadcast([c], pg, name, flat.to(self.device), metas, version, last)
                    nbytes += flat.numel()
            finally:
                if fan.needs_session(k):
                    self._wait(c.end_weight_update())
            log.warning("engine_%d (%s) re-synced to weight version %d over weight-update group %r: %.1f MB in %.2f s",
                        k, c.url, version, name, nbytes / 1e6, time.perf_counter() - t0)
        finally:
            try:
                self._wait(c.destroy_weights_update_group(name))
            finally:
                weight_group.destroy(pg)
        return True

    def engine_restarted(self, k: int) -> None:
        """The group lost a member: dropped everywhere, rebuilt on the next update."""
        if self.group is None:
            return
        others = [c for i, c in enumerate(self.fan.clients) if i != k]
        self._wait(_gather([c.destroy_weights_update_group(self.group_name) for c in others], return_exceptions=True))
        weight_group.destroy(self.group)
        self.group = None

    def close(self) -> None:
        if self.group is None:
            return
        fut = self.fan.submit(_gather([c.destroy_weights_update_group(self.group_name) for c in self.fan.clients],
                                      return_exceptions=True))
        weight_group.destroy(self.group)
        fut.result(timeout=30)
        self.group = None


class DiskTransport(Transport):
    """``disk``: shards in a folder, loaded by every engine through ``/update_weights_from_disk``."""

    name = "disk"

    def __init__(self, fan: Fanout, model_dir: str = ""):
        super().__init__(fan)
        self.model_dir = model_dir  # its config.json / generation_config.json go beside the shards

    def update(self, buckets, version: int, failed: dict) -> None:
        """With fault tolerance on, the folder is the snapshot (committed first, so a recovered engine
        loads it too); else a temporary folder, removed afterwards."""
        fan = self.fan
        if fan.snapshot is not None:
            for bucket in buckets:
                fan.snapshot.add_named(bucket)
            d = fan.snapshot.commit()
            fan.guarded_all(lambda c: c.update_weights_from_disk(d, weight_version=str(version)))
            return
        from safetensors.torch import save_file

        d = tempfile.mkdtemp(prefix="megaforge-weights-")
        try:
            for k, bucket in enumerate(buckets):
                save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, os.path.join(d, f"model-{k:05d}.safetensors"))
            for f in ("config.json", "generation_config.json"):
                if self.model_dir and os.path.exists(os.path.join(self.model_dir, f)):
                    shutil.copy(os.path.join(self.model_dir, f), d)
            fan.submit(_gather([c.update_weights_from_disk(d, weight_version=str(version)) for c in fan.clients])).result()
        finally:
            shutil.rmtree(d, ignore_errors=True)


def make_transport(name: str, fan: Fanout, model_dir: str = "",
                   group_name: str = "megaforge_weight_update") -> Transport:
    """The transport ``name`` (``sync.transport``) over ``fan``."""
    if name == "inproc":
        raise ValueError("sync.transport 'inproc' needs rollout.engine: embedded (these engines are other processes)")
    if name not in TRANSPORTS:
        raise ValueError(f"sync.transport {name!r}: valid for HTTP engines: {list(TRANSPORTS)}")
    if name == "nccl":
        return NcclTransport(fan, group_name)
    if name == "disk":
        return DiskTransport(fan, model_dir)
    return {"auto": TensorTransport, "shm": ShmTransport, "ipc": IpcTransport}[name](fan)
