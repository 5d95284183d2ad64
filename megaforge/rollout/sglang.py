"""Engines behind SGLang's native HTTP API: real SGLang servers (``rollout.engine: sglang``) or
megaforge's embedded server (``rollout.engine: embedded_server``), through one client.

:class:`HTTPEngine` implements :class:`megaforge.rollout.base.Engine` over one or more servers:

* ``generate``: one batch ``/generate`` per server (contiguous chunks of the request list, so a
  single server sees the whole step as one batch), or one request per sample through the router when
  there is one. Every request asks ``return_logprob``; answers map to :class:`Completion`.
* ``update_weights(buckets, version)`` by ``sync.transport``:
  ``auto`` / ``shm`` / ``ipc``: ``/update_weights_from_tensor`` with ``load_format:
  "flattened_bucket"`` (:mod:`megaforge.sync.wire`), inside ``/begin_weight_update`` ..
  ``/end_weight_update`` where the server's release needs that session (SGLang >= 0.5.21;
  :mod:`megaforge.rollout.versions`): ``shm`` copies every bucket into CPU shared memory, ``ipc``
  sends CUDA buckets as CUDA IPC handles, ``auto`` does whichever fits the trainer's tensors;
  ``nccl``: ``/init_weights_update_group`` once (this process is rank 0; backend nccl for CUDA
  tensors, gloo for CPU ones), then per bucket ``/update_weights_from_distributed`` plus one broadcast
  of the flat buffer; ``disk``: safetensors shards in a temporary folder and
  ``/update_weights_from_disk``. The last bucket carries ``weight_version = str(version)`` and
  ``flush_cache``; the next bucket is gathered while the server loads the current one.
* ``release_memory`` / ``resume_memory`` send only tags whose state changes (SGLang fails on resuming
  a tag that was not released), and the engine refuses weight updates while ``weights`` is released.
* ``weight_version`` asks every server (``/model_info``) and fails if they disagree.
* ``caps``: each server's release and abilities (:class:`megaforge.rollout.versions.ServerCaps`), read
  from ``/server_info`` when the engine is built and after every restart.
* fault tolerance (:mod:`megaforge.rollout.recovery`): a dead or hung engine is restarted, re-synced
  from the weight snapshot (:mod:`megaforge.rollout.snapshot`, written by every update), its memory
  state restored and its unfinished requests re-issued, ``rollout.max_restarts`` times per step.

The sync methods run coroutines on a private event-loop thread; ``abort()`` is safe from any thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from typing import Iterable, Optional, Sequence

import torch

from megaforge.sync import wire
from megaforge.rollout.base import MEMORY_TAGS, Engine, check_tags
from megaforge.rollout.client import SGLangClient
from megaforge.rollout.protocol import completion_from_output
from megaforge.rollout.recovery import ROUTER, EngineFailure, Recovery  # noqa: F401  (EngineFailure: re-export)
from megaforge.rollout.snapshot import WeightSnapshot
from megaforge.rollout.versions import ServerCaps, caps_from_server_info
from megaforge.types import Completion, GenerateRequest

TRANSPORTS = ("auto", "shm", "ipc", "nccl", "disk")
log = logging.getLogger("megaforge.rollout.sglang")


class EngineStateError(RuntimeError):
    pass


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


class HTTPEngine(Recovery, Engine):
    def __init__(self, urls: Sequence[str], api_key: str = "", router_url: Optional[str] = None,
                 timeout_s: float = 600.0, transport: str = "auto", tp_sizes: Optional[Sequence[int]] = None,
                 processes: Sequence = (), model_dir: str = "", cleanup_dirs: Sequence[str] = (),
                 max_concurrency: int = 256, group_name: str = "megaforge_weight_update",
                 max_restarts: int = 0, snapshot_dir: str = "", health_timeout_s: float = 30.0,
                 startup_timeout_s: float = 600.0):
        """``max_restarts`` > 0 turns fault tolerance on (:mod:`megaforge.rollout.recovery`): every weight
        update also writes the snapshot (under ``snapshot_dir``, a temporary folder when empty)."""
        if transport == "inproc":
            raise ValueError("sync.transport 'inproc' needs rollout.engine: embedded (these engines are other processes)")
        if transport not in TRANSPORTS:
            raise ValueError(f"sync.transport {transport!r}: valid for HTTP engines: {list(TRANSPORTS)}")
        if not urls:
            raise ValueError("HTTPEngine needs at least one server URL")
        self.transport, self.model_dir, self.group_name = transport, model_dir, group_name
        self.tp_sizes = list(tp_sizes or [1] * len(urls))
        self.clients = [SGLangClient(u, api_key, timeout_s, max_concurrency) for u in urls]
        self.router = SGLangClient(router_url, api_key, timeout_s, max_concurrency) if router_url else None
        self.processes, self.cleanup_dirs = list(processes), list(cleanup_dirs)
        self.timeout_s = timeout_s
        self._released: set[str] = set()
        self._pg = None
        self._group_device: Optional[torch.device] = None  # where the weight-update group's buckets live
        self.snapshot = WeightSnapshot(snapshot_dir, model_dir) if max_restarts > 0 else None
        self._init_recovery(max_restarts, health_timeout_s, startup_timeout_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megaforge-engine-http", daemon=True)
        self._thread.start()
        self._closed = False
        self.caps: list[ServerCaps] = [self._read_caps(c) for c in self.clients]

    # ----------------------------------------------------------------------------------- plumbing
    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro):
        return self._submit(coro).result()

    def _read_caps(self, client: SGLangClient) -> ServerCaps:
        caps = caps_from_server_info(self._call(client.get_server_info()), client.url)
        log.info("engine %s: %s", client.url, caps.label)
        return caps

    def _session(self, k: int) -> bool:
        """Whether engine ``k``'s weight updates need /begin_weight_update .. /end_weight_update."""
        return self.caps[k].weight_update_session

    def _all(self, fn):
        """Run ``fn(client)`` on every server concurrently; the list of answers."""
        async def run():
            return await asyncio.gather(*(fn(c) for c in self.clients))
        return self._call(run())

    # ----------------------------------------------------------------------------------- generate
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """One completion per request, in order. Chunks whose engine failed are re-issued after the
        engine's recovery, minus the requests already answered; answers are kept once per rid."""
        if not requests:
            return []
        if self._released & {"weights", "kv_cache"}:
            raise EngineStateError(f"generate called while engine memory is released ({sorted(self._released)})")
        seen: set[str] = set()
        rids = []
        for r in requests:
            rid = r.rid if (r.rid and r.rid not in seen) else f"{r.rid or 'req'}-{uuid.uuid4().hex[:12]}"
            seen.add(rid)
            rids.append(rid)
        where = {rid: i for i, rid in enumerate(rids)}
        if self.router is not None:
            pending = [(ROUTER, [i]) for i in range(len(requests))]
        else:
            size = -(-len(requests) // len(self.clients))
            pending = [(k, list(range(s, min(s + size, len(requests))))) for k, s in enumerate(range(0, len(requests), size))]

        async def one(client: SGLangClient, idx: list[int]):
            payload = {"input_ids": [requests[i].input_ids for i in idx],
                       "sampling_params": [requests[i].sampling.to_sglang() for i in idx],
                       "return_logprob": True, "rid": [rids[i] for i in idx]}
            outs = await client.generate(payload)
            if not isinstance(outs, list) or len(outs) != len(idx):
                raise ValueError(f"{client.url}/generate: expected {len(idx)} answers, got {type(outs).__name__} "
                                 f"{len(outs) if isinstance(outs, list) else ''}")
            return [completion_from_output(o, f"{client.url}/generate") for o in outs]

        out: list[Optional[Completion]] = [None] * len(requests)
        while pending:
            round_epochs = list(self._epochs)
            epochs = [None if k == ROUTER else self._epochs[k] for k, _ in pending]
            clients = [self.router if k == ROUTER else self.clients[k] for k, _ in pending]
            results = self._call(_gather([one(c, idx) for c, (_, idx) in zip(clients, pending)], return_exceptions=True))
            failed = []
            for (k, idx), ep, res in zip(pending, epochs, results):
                if isinstance(res, BaseException):
                    if not isinstance(res, Exception) or not self._is_fault(k, res):
                        raise res
                    failed.append((k, idx, ep, res))
                    continue
                for i, c in zip(idx, res):
                    i = where.get(c.rid, i)  # by rid (the server echoes it), else by position
                    if out[i] is None:  # an answer is kept once
                        c.rid = requests[i].rid
                        out[i] = c
            pending = []
            router_failed = [err for k, _, _, err in failed if k == ROUTER]
            if router_failed:  # once per round: which engine behind the router failed is found by health checks
                self._recover_any(router_failed[0], round_epochs)
            for k, idx, ep, err in failed:
                if k != ROUTER:
                    self._recover(k, err, ep)
                left = [i for i in idx if out[i] is None]
                if left:
                    pending.append((k, left))
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        versions = self._guarded_all(lambda c: c.get_weight_version())
        if len(set(versions)) != 1:
            raise EngineStateError("engines serve different weight versions: "
                                   + ", ".join(f"{c.url}={v}" for c, v in zip(self.clients, versions)))
        return versions[0]

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """Every bucket reaches every engine and (fault tolerance on) the snapshot of ``version``; an
        engine that fails meanwhile is restarted afterwards and loads the complete snapshot."""
        if "weights" in self._released:
            raise EngineStateError("update_weights called while the engine weights are released; resume 'weights' first")
        if self.snapshot is not None:
            self.snapshot.begin(version)
        failed: dict[int, tuple] = {}  # engine -> (epoch, error) of a fault during this update
        try:
            if self.transport == "disk":
                self._update_from_disk(buckets, version)
            else:
                self._guarded_all(lambda c: c.begin_weight_update() if self._session(self.clients.index(c))
                                  else _nothing())
                try:
                    if self.transport == "nccl":
                        self._update_distributed(buckets, version)
                    else:
                        self._update_from_tensor(buckets, version, failed)
                finally:
                    self._end_session(failed)
                if self.snapshot is not None:  # written in the background unless a failed engine needs it now
                    self.snapshot.commit(wait=bool(failed))
        except BaseException:
            if self.snapshot is not None:
                self.snapshot.abort()
            raise
        for k, (ep, err) in sorted(failed.items()):
            self._recover(k, err, ep)  # loads the snapshot just committed

    def _send_all(self, make, failed: dict):
        """Submit ``make(k, client)`` to every engine not in ``failed``; returns ``wait()``, which waits,
        records the engines that failed with a fault in ``failed`` and raises any other error."""
        ks = [k for k in range(len(self.clients)) if k not in failed]
        epochs = [self._epochs[k] for k in ks]

        async def run():
            return await asyncio.gather(*(make(k, self.clients[k]) for k in ks), return_exceptions=True)

        fut = self._submit(run())

        def wait() -> None:
            for k, ep, r in zip(ks, epochs, fut.result()):
                if isinstance(r, BaseException):
                    if not isinstance(r, Exception) or not self._is_fault(k, r):
                        raise r
                    failed[k] = (ep, r)
        return wait

    def _end_session(self, failed: dict) -> None:
        self._send_all(lambda k, c: c.end_weight_update() if self._session(k) else _nothing(), failed)()

    def _update_from_tensor(self, buckets, version: int, failed: dict) -> None:
        """CUDA buckets (ipc) go through two reused device buffers (megaforge.sync.buffers: a buffer is
        rewritten only after the engines confirmed the load of the bucket it carried), with
        generation paused around the update; CPU buckets (shm) through fresh shared-memory buffers."""
        from megaforge.sync.buffers import BucketBuffers

        inflight: Optional[tuple] = None
        sent = False
        pool: Optional[BucketBuffers] = None
        try:
            for bucket, last in _lookahead(buckets):
                cuda = bucket[0][1].is_cuda and self.transport != "shm"
                if self.transport == "ipc" and not cuda:
                    raise ValueError("sync.transport 'ipc' needs CUDA tensors; the trainer's are on "
                                     f"{bucket[0][1].device} (use 'shm' or 'auto')")
                if cuda and pool is None:
                    self._send_all(lambda k, c: c.pause_generation("abort"), failed)()
                    pool = BucketBuffers(bucket[0][1].device)
                if cuda:
                    flat, metas, slot = pool.flatten(bucket)
                else:
                    flat, metas = wire.flatten(bucket, to_cpu=self.transport == "shm")
                fut = self._send_all(lambda k, c, flat=flat, metas=metas, last=last: c.update_weights_from_tensor(
                    [wire.flattened_bucket_payload(flat, metas) for _ in range(self.tp_sizes[k])],
                    load_format=wire.FLATTENED_BUCKET, flush_cache=last, weight_version=str(version) if last else None),
                    failed)
                if cuda:
                    pool.sent(slot, fut)
                if self.snapshot is not None:  # written while the engines load the same bucket
                    self.snapshot.add_flat(flat, metas)
                if inflight is not None:
                    inflight[0]()
                inflight = (fut, flat)  # the buffer stays alive until its request is answered
                sent = True
            if inflight is not None:
                inflight[0]()
            if not sent:
                self._send_all(lambda k, c: c.update_weight_version(str(version)), failed)()
        finally:
            if pool is not None:
                try:
                    pool.close()
                finally:
                    self._send_all(lambda k, c: c.continue_generation(), failed)()

    def _group_address(self) -> str:
        """Where the engines reach this process's weight-update group store."""
        from megaforge.rollout.launcher import connect_host

        hosts = {c.url.split("//", 1)[1].rsplit(":", 1)[0] for c in self.clients}
        local = all(connect_host(h.strip("[]")) in ("127.0.0.1", "::1", "localhost") for h in hosts)
        return "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())

    def _join_group(self, clients: list, offsets: list[int], world: int, name: str, device: torch.device):
        """A weight-update group of this process (rank 0) and ``clients`` (from ``offsets``)."""
        from megaforge.sync import weight_group
        from megaforge.rollout.launcher import free_port

        addr = self._group_address()
        port = free_port(addr)
        backend = "nccl" if device.type == "cuda" else "gloo"
        fut = self._submit(_gather([c.init_weights_update_group(addr, port, off, world, name, backend)
                                    for c, off in zip(clients, offsets)]))
        try:
            pg = weight_group.init_custom_process_group(backend, addr, port, world, 0, name,
                                                        timeout_s=min(self.timeout_s, 600.0))
        except Exception as e:
            try:
                fut.result(timeout=5.0)
                why = ""
            except Exception as fe:  # noqa: BLE001
                why = f"; an engine said: {fe}"
            raise EngineStateError(f"weight-update group ({backend}, {addr}:{port}, world {world}) failed: {e}{why}") from e
        fut.result()
        return pg

    def _ensure_group(self, device: torch.device) -> None:
        if self._pg is not None:
            return
        offsets = [1 + sum(self.tp_sizes[:k]) for k in range(len(self.clients))]
        self._pg = self._join_group(self.clients, offsets, 1 + sum(self.tp_sizes), self.group_name, device)
        self._group_device = device

    def _broadcast_bucket(self, clients: list, pg, name: str, flat: torch.Tensor, metas, version: int, last: bool) -> None:
        """``/update_weights_from_distributed`` to ``clients`` and one broadcast of ``flat`` in ``pg``."""
        import torch.distributed as dist

        fut = self._submit(_gather([c.update_weights_from_distributed(
            [m.name for m in metas], [str(m.dtype).removeprefix("torch.") for m in metas],
            [list(m.shape) for m in metas], group_name=name, flush_cache=last,
            weight_version=str(version) if last else None, load_format=wire.FLATTENED_BUCKET) for c in clients]))
        work = dist.broadcast(flat, src=0, group=pg, async_op=True)
        while not work.is_completed():  # an engine that refuses the bucket never joins: fail, not hang
            if fut.done() and fut.exception() is not None:
                raise EngineStateError(f"an engine refused a distributed weight bucket: {fut.exception()}")
            time.sleep(0.002)
        work.wait()
        fut.result()

    def _update_distributed(self, buckets, version: int) -> None:
        for bucket, last in _lookahead(buckets):
            named = wire.packing_order(bucket)
            self._ensure_group(named[0][1].device)
            flat, metas = wire.flatten(named, shared=False)
            try:
                self._broadcast_bucket(self.clients, self._pg, self.group_name, flat, metas, version, last)
            except EngineStateError:
                self._pg = None
                raise
            if self.snapshot is not None:
                self.snapshot.add_flat(flat, metas)

    def _resync(self, k: int, version: int) -> None:
        """A restarted engine ``k`` loads the snapshot of ``version``: over a weight-update group of its
        own with ``sync.transport nccl`` (the transport the run already uses, which also reaches an
        engine that cannot read this machine's disk), else from the snapshot folder on disk."""
        if self.transport != "nccl" or self._group_device is None:
            self._call(self.clients[k].update_weights_from_disk(self.snapshot.path, weight_version=str(version)))
            return
        from megaforge.sync import weight_group
        from megaforge.rollout.snapshot import read_flat

        c, name = self.clients[k], f"{self.group_name}-resync-{k}-{self._epochs[k]}"
        t0 = time.perf_counter()
        pg = self._join_group([c], [1], 1 + self.tp_sizes[k], name, self._group_device)
        try:
            nbytes = 0
            if self._session(k):
                self._call(c.begin_weight_update())
            try:
                for path, last in _lookahead(self.snapshot.files()):
                    flat, metas = read_flat(path)
                    self._broadcast_bucket([c], pg, name, flat.to(self._group_device), metas, version, last)
                    nbytes += flat.numel()
            finally:
                if self._session(k):
                    self._call(c.end_weight_update())
            log.warning("engine_%d (%s) re-synced to weight version %d over weight-update group %r: %.1f MB in %.2f s",
                        k, c.url, version, name, nbytes / 1e6, time.perf_counter() - t0)
        finally:
            try:
                self._call(c.destroy_weights_update_group(name))
            finally:
                weight_group.destroy(pg)

    def _update_from_disk(self, buckets, version: int) -> None:
        """Shards in a folder, loaded by every engine; with fault tolerance on, the folder is the
        snapshot (committed first, so a recovered engine loads it too)."""
        if self.snapshot is not None:
            for bucket in buckets:
                self.snapshot.add_named(bucket)
            d = self.snapshot.commit()
            self._guarded_all(lambda c: c.update_weights_from_disk(d, weight_version=str(version)))
            return
        from safetensors.torch import save_file

        d = tempfile.mkdtemp(prefix="megaforge-weights-")
        try:
            for k, bucket in enumerate(buckets):
                save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, os.path.join(d, f"model-{k:05d}.safetensors"))
            for f in ("config.json", "generation_config.json"):
                if self.model_dir and os.path.exists(os.path.join(self.model_dir, f)):
                    shutil.copy(os.path.join(self.model_dir, f), d)
            self._all(lambda c: c.update_weights_from_disk(d, weight_version=str(version)))
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def named_weights(self):
        raise NotImplementedError("an HTTP engine's tensors live in its server; sync.check_equal reads them through "
                                  "query() (megaforge.sync.check)")

    def query(self, method: str, endpoint: str, payload=None) -> list:
        """One answer per server to ``method endpoint`` (e.g. /get_weights_checksum for sync.check_equal)."""
        return self._guarded_all(lambda c: c.request(method, endpoint, payload))

    # ------------------------------------------------------------------------------------- memory
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        todo = [t for t in check_tags(tags) if t not in self._released]
        if todo:
            self._guarded_all(lambda c: c.release_memory_occupation(todo))
            self._released |= set(todo)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        todo = [t for t in check_tags(tags) if t in self._released]
        if todo:
            self._guarded_all(lambda c: c.resume_memory_occupation(todo))
            self._released -= set(todo)

    @property
    def released(self) -> set[str]:
        return set(self._released)

    # ------------------------------------------------------------------------------ health, abort
    def health(self) -> bool:
        return all(self._all(lambda c: c.health_generate()))

    def restart_server(self, k: int, timeout_s: float = 600.0, reason: str = "", restore_memory: bool = True) -> None:
        """Restart engine ``k`` (one this engine launched). It comes back with its initial weights and
        version 0 (``restore_memory``: in the engines' memory state); the recovery path
        (:mod:`megaforge.rollout.recovery`) re-syncs its weights from the snapshot, then its memory."""
        proc = self._proc(k)
        if proc is None:
            raise ValueError(f"engine {k} was not launched by this HTTPEngine; it cannot restart it")
        old = self.clients[k]
        try:
            proc.restart(timeout_s, grace_s=3.0, reason=reason, require_same_port=self.router is not None)
        finally:
            self._call(old.close())
        self.clients[k] = SGLangClient(proc.url, old.api_key, old.timeout_s, old.max_concurrency)
        self.caps[k] = self._read_caps(self.clients[k])
        if self._pg is not None:  # the group lost a member: dropped everywhere, rebuilt on the next update
            from megaforge.sync import weight_group

            others = [c for i, c in enumerate(self.clients) if i != k]
            self._call(_gather([c.destroy_weights_update_group(self.group_name) for c in others], return_exceptions=True))
            weight_group.destroy(self._pg)
            self._pg = None
        if self._released and restore_memory:  # keep one memory state across engines
            self._call(self.clients[k].release_memory_occupation(sorted(self._released)))

    def abort(self) -> None:
        """Abort on every engine; a dead or hung one has nothing to abort (the next call restarts it)."""
        res = self._call(_gather([c.abort_request(abort_all=True) for c in self.clients], return_exceptions=True))
        for k, r in enumerate(res):
            if isinstance(r, BaseException) and (not isinstance(r, Exception) or not self._is_fault(k, r)):
                raise r

    def flush_cache(self) -> None:
        self._guarded_all(lambda c: c.flush_cache())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._pg is not None:
                from megaforge.sync import weight_group

                fut = self._submit(_gather([c.destroy_weights_update_group(self.group_name) for c in self.clients],
                                           return_exceptions=True))
                weight_group.destroy(self._pg)
                fut.result(timeout=30)
                self._pg = None
        except Exception:  # noqa: BLE001  (best effort: the servers stop next anyway)
            pass
        clients = self.clients + ([self.router] if self.router else [])
        try:
            self._call(_gather([c.close() for c in clients]))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            for p in reversed(self.processes):
                p.stop()
            for d in self.cleanup_dirs:
                shutil.rmtree(d, ignore_errors=True)
            if self.snapshot is not None:
                self.snapshot.close()



_MOVED = ("SGLANG_TESTED", "require_sglang", "gpu_assignment", "build_http_engine")


def __getattr__(name):  # the launching code lives in megaforge.rollout.http_launch
    if name in _MOVED:
        from megaforge.rollout import http_launch

        return getattr(http_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
