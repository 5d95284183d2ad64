"""Engines behind SGLang's native HTTP API: real SGLang servers (``rollout.engine: sglang``) or
megaforge's embedded server (``rollout.engine: embedded_server``), through one client.

:class:`HTTPEngine` implements :class:`megaforge.rollout.base.Engine` over one or more servers:

* ``generate``: one batch ``/generate`` per server (contiguous chunks of the request list, so a
  single server sees the whole step as one batch), or one request per sample through the router when
  there is one. Every request asks ``return_logprob``; answers map to :class:`Completion`. Requests
  with ``return_routed_experts`` also ask for the routing (decoded by :mod:`megaforge.rollout.routing`).
* ``update_weights(buckets, version)`` by ``sync.transport`` (``auto`` / ``shm`` / ``ipc`` / ``nccl`` /
  ``disk``): one transport of :mod:`megaforge.sync.transports`, over this engine as its
  :class:`~megaforge.sync.transports.Fanout` (per-engine async clients, the event loop, the fault
  bookkeeping, the weight snapshot).
* ``adapter_path`` / ``load_adapter`` (``sync.lora_adapters``): LoRA adapters alone, loaded as PEFT
  folders and named by every ``/generate`` (:mod:`megaforge.rollout.http.lora`).
* ``release_memory`` / ``resume_memory`` send only tags whose state changes (SGLang fails on resuming
  a tag that was not released), and the engine refuses weight updates while ``weights`` is released.
* ``weight_version`` asks every server (``/model_info``) and fails if they disagree.
* ``caps``: each server's release and abilities (:class:`megaforge.rollout.http.versions.ServerCaps`), read
  from ``/server_info`` when the engine is built and after every restart.
* fault tolerance (:mod:`megaforge.rollout.http.recovery`): a dead or hung engine is restarted, re-synced
  from the weight snapshot (:mod:`megaforge.rollout.http.snapshot`, written by every update), its memory
  state restored and its unfinished requests re-issued, ``rollout.max_restarts`` times per step.

The sync methods run coroutines on a private event-loop thread; ``abort()`` is safe from any thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
import threading
import uuid
from typing import Iterable, Optional, Sequence

import torch

from megaforge.rollout.base import MEMORY_TAGS, Engine, EngineStateError, check_tags
from megaforge.rollout.http.client import SGLangClient
from megaforge.rollout.http.lora import AdapterServing
from megaforge.rollout.http.protocol import completion_from_output
from megaforge.rollout.http.recovery import ROUTER, Recovery
from megaforge.rollout.http.snapshot import WeightSnapshot
from megaforge.rollout.http.versions import ServerCaps, caps_from_server_info
from megaforge.sync.transports import make_transport
from megaforge.types import Completion, GenerateRequest

log = logging.getLogger("megaforge.rollout.http.engine")


async def _gather(coros, return_exceptions: bool = False):
    return await asyncio.gather(*coros, return_exceptions=return_exceptions)


class HTTPEngine(AdapterServing, Recovery, Engine):
    def __init__(self, urls: Sequence[str], api_key: str = "", router_url: Optional[str] = None,
                 timeout_s: float = 600.0, transport: str = "auto", tp_sizes: Optional[Sequence[int]] = None,
                 processes: Sequence = (), model_dir: str = "", cleanup_dirs: Sequence[str] = (),
                 max_concurrency: int = 256, group_name: str = "megaforge_weight_update",
                 max_restarts: int = 0, snapshot_dir: str = "", health_timeout_s: float = 30.0,
                 startup_timeout_s: float = 600.0, health_probe: str = "/health_generate"):
        """``max_restarts`` > 0 turns fault tolerance on (:mod:`megaforge.rollout.http.recovery`): every weight
        update also writes the snapshot (under ``snapshot_dir``, a temporary folder when empty).
        ``health_probe``: the endpoint of the health check (the engine kind's ``Servers.health_probe``)."""
        self.weight_transport = make_transport(transport, self, model_dir, group_name)  # checks the name first
        if not urls:
            raise ValueError("HTTPEngine needs at least one server URL")
        self.transport, self.model_dir = transport, model_dir
        self.tp_sizes = list(tp_sizes or [1] * len(urls))
        self.clients = [SGLangClient(u, api_key, timeout_s, max_concurrency) for u in urls]
        self.router = SGLangClient(router_url, api_key, timeout_s, max_concurrency) if router_url else None
        self.processes, self.cleanup_dirs = list(processes), list(cleanup_dirs)
        self.timeout_s = timeout_s
        self._released: set[str] = set()
        self.snapshot = WeightSnapshot(snapshot_dir, model_dir) if max_restarts > 0 else None
        self._init_recovery(max_restarts, health_timeout_s, startup_timeout_s, health_probe)
        self._init_adapters()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megaforge-engine-http", daemon=True)
        self._thread.start()
        self._closed = False
        self.caps: list[ServerCaps] = [self._read_caps(c) for c in self.clients]

    # ----------------------------------------------------------------------------------- plumbing
    def submit(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the engine's event loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro):
        return self.submit(coro).result()

    def _read_caps(self, client: SGLangClient) -> ServerCaps:
        caps = caps_from_server_info(self._call(client.get_server_info()), client.url)
        log.info("engine %s: %s", client.url, caps.label)
        return caps

    @property
    def openai_base_urls(self) -> list[str]:
        """The OpenAI-compatible base URL (``<server>/v1``) of the router, when there is one, else of each
        server: real SGLang and megaforge's embedded server both serve ``/v1/models``,
        ``/v1/completions`` and ``/v1/chat/completions`` there. For a ``rollout.generate_fn``:
        ``openai.OpenAI(base_url=engine.openai_base_urls[0], api_key=engine.api_key or "none")``."""
        return [f"{c.url}/v1" for c in ([self.router] if self.router is not None else self.clients)]

    @property
    def api_key(self) -> str:
        """The bearer key of the servers ("" when they have none)."""
        return self.clients[0].api_key

    def needs_session(self, k: int) -> bool:
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

        lora = self._acquire_adapter()  # sync.lora_adapters: the adapter every request of this call names
        try:
            return self._generate(requests, rids, where, pending, lora)
        finally:
            self._release_adapter(lora)

    def _generate(self, requests, rids, where, pending, lora: Optional[str]) -> list[Completion]:
        async def one(client: SGLangClient, idx: list[int]):
            payload = {"input_ids": [requests[i].input_ids for i in idx],
                       "sampling_params": [requests[i].sampling.to_sglang() for i in idx],
                       "return_logprob": True, "rid": [rids[i] for i in idx]}
            if lora is not None:  # GenerateReqInput.lora_path: one adapter name per request
                payload["lora_path"] = [lora] * len(idx)
            routed = any(requests[i].return_routed_experts for i in idx)
            if routed:  # one flag per batch request (sglang's GenerateReqInput.return_routed_experts: bool)
                payload["return_routed_experts"] = True
            outs = await client.generate(payload)
            if not isinstance(outs, list) or len(outs) != len(idx):
                raise ValueError(f"{client.url}/generate: expected {len(idx)} answers, got {type(outs).__name__} "
                                 f"{len(outs) if isinstance(outs, list) else ''}")
            return [completion_from_output(o, f"{client.url}/generate",
                                           routed_prompt_len=len(requests[i].input_ids) if routed else None)
                    for i, o in zip(idx, outs)]

        out: list[Optional[Completion]] = [None] * len(requests)
        while pending:
            round_epochs = list(self._epochs)
            epochs = [None if k == ROUTER else self._epochs[k] for k, _ in pending]
            clients = [self.router if k == ROUTER else self.clients[k] for k, _ in pending]
            results = self._call(_gather([one(c, idx) for c, (_, idx) in zip(clients, pending)], return_exceptions=True))
            failed = []
            for (k, idx), ep, res in zip(pending, epochs, results):
                if isinstance(res, BaseException):
                    if not isinstance(res, Exception) or not self.is_fault(k, res):
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
        versions = self.guarded_all(lambda c: c.get_weight_version())
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
            self.weight_transport.update(buckets, version, failed)
        except BaseException:
            if self.snapshot is not None:
                self.snapshot.abort()
            raise
        for k, (ep, err) in sorted(failed.items()):
            self._recover(k, err, ep)  # loads the snapshot just committed

    def _resync(self, k: int, version: int) -> None:
        """A restarted engine ``k`` loads the snapshot of ``version``: through the run's transport where
        it re-syncs one engine (``nccl``: a weight-update group of its own, which also reaches an engine
        that cannot read this machine's disk), else from the snapshot folder on disk."""
        if not self.weight_transport.resync(k, version):
            self._call(self.clients[k].update_weights_from_disk(self.snapshot.path, weight_version=str(version)))

    def named_weights(self):
        raise NotImplementedError("an HTTP engine's tensors live in its server; sync.check_equal reads them through "
                                  "query() (megaforge.sync.check)")

    def query(self, method: str, endpoint: str, payload=None) -> list:
        """One answer per server to ``method endpoint`` (e.g. /get_weights_checksum for sync.check_equal)."""
        return self.guarded_all(lambda c: c.request(method, endpoint, payload))

    # ------------------------------------------------------------------------------------- memory
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        todo = [t for t in check_tags(tags) if t not in self._released]
        if todo:
            self.guarded_all(lambda c: c.release_memory_occupation(todo))
            self._released |= set(todo)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        todo = [t for t in check_tags(tags) if t in self._released]
        if todo:
            self.guarded_all(lambda c: c.resume_memory_occupation(todo))
            self._released -= set(todo)

    @property
    def released(self) -> set[str]:
        return set(self._released)

    # ------------------------------------------------------------------------------ health, abort
    def health(self) -> bool:
        return all(self._all(lambda c: c.health_generate()))

    def restart_server(self, k: int, timeout_s: float = 600.0, reason: str = "", restore_memory: bool = True) -> None:
        """Restart engine ``k`` (one this engine started). It comes back with its initial weights and
        version 0 (``restore_memory``: in the engines' memory state); the recovery path
        (:mod:`megaforge.rollout.http.recovery`) re-syncs its weights from the snapshot, then its memory."""
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
        self.weight_transport.engine_restarted(k)
        if self._released and restore_memory:  # keep one memory state across engines
            self._call(self.clients[k].release_memory_occupation(sorted(self._released)))

    def abort(self) -> None:
        """Abort on every engine; a dead or hung one has nothing to abort (the next call restarts it)."""
        res = self._call(_gather([c.abort_request(abort_all=True) for c in self.clients], return_exceptions=True))
        for k, r in enumerate(res):
            if isinstance(r, BaseException) and (not isinstance(r, Exception) or not self.is_fault(k, r)):
                raise r

    def flush_cache(self) -> None:
        self.guarded_all(lambda c: c.flush_cache())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.weight_transport.close()
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
