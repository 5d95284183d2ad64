"""Engines behind SGLang's native HTTP API: real SGLang servers (``rollout.engine: sglang``) or
megaforge's embedded server (``rollout.engine: embedded_server``), through one client.

:class:`HTTPEngine` implements :class:`megaforge.rollout.base.Engine` over one or more servers:

* ``generate``: one batch ``/generate`` per server (contiguous chunks of the request list, so a
  single server sees the whole step as one batch), or one request per sample through the router when
  there is one. Every request asks ``return_logprob``; answers map to :class:`Completion`.
* ``update_weights(buckets, version)`` by ``sync.transport``:
  ``auto`` / ``shm`` / ``ipc``: ``/update_weights_from_tensor`` with ``load_format:
  "flattened_bucket"`` (:mod:`megaforge.rollout.wire`), inside ``/begin_weight_update`` ..
  ``/end_weight_update``: ``shm`` copies every bucket into CPU shared memory, ``ipc`` sends CUDA
  buckets as CUDA IPC handles, ``auto`` does whichever fits the trainer's tensors;
  ``nccl``: ``/init_weights_update_group`` once (this process is rank 0; backend nccl for CUDA
  tensors, gloo for CPU ones), then per bucket ``/update_weights_from_distributed`` plus one broadcast
  of the flat buffer; ``disk``: safetensors shards in a temporary folder and
  ``/update_weights_from_disk``. The last bucket carries ``weight_version = str(version)`` and
  ``flush_cache``; the next bucket is gathered while the server loads the current one.
* ``release_memory`` / ``resume_memory`` send only tags whose state changes (SGLang fails on resuming
  a tag that was not released), and the engine refuses weight updates while ``weights`` is released.
* ``weight_version`` asks every server (``/model_info``) and fails if they disagree.

The sync methods run coroutines on a private event-loop thread; ``abort()`` is safe from any thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Iterable, Optional, Sequence

import torch

from megaforge.rollout import wire
from megaforge.rollout.base import MEMORY_TAGS, Engine, check_tags
from megaforge.rollout.client import SGLangClient
from megaforge.rollout.protocol import completion_from_output
from megaforge.types import Completion, GenerateRequest

TRANSPORTS = ("auto", "shm", "ipc", "nccl", "disk")


class EngineStateError(RuntimeError):
    pass


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


class HTTPEngine(Engine):
    def __init__(self, urls: Sequence[str], api_key: str = "", router_url: Optional[str] = None,
                 timeout_s: float = 600.0, transport: str = "auto", tp_sizes: Optional[Sequence[int]] = None,
                 processes: Sequence = (), model_dir: str = "", cleanup_dirs: Sequence[str] = (),
                 max_concurrency: int = 256, group_name: str = "megaforge_weight_update"):
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
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="megaforge-engine-http", daemon=True)
        self._thread.start()
        self._closed = False

    # ----------------------------------------------------------------------------------- plumbing
    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro):
        return self._submit(coro).result()

    def _all(self, fn):
        """Run ``fn(client)`` on every server concurrently; the list of answers."""
        async def run():
            return await asyncio.gather(*(fn(c) for c in self.clients))
        return self._call(run())

    # ----------------------------------------------------------------------------------- generate
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
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
        if self.router is not None:
            chunks = [[i] for i in range(len(requests))]
            targets = [self.router] * len(chunks)
        else:
            n = len(self.clients)
            size = -(-len(requests) // n)
            chunks = [list(range(s, min(s + size, len(requests)))) for s in range(0, len(requests), size)]
            targets = self.clients[: len(chunks)]

        async def one(client: SGLangClient, idx: list[int]):
            payload = {"input_ids": [requests[i].input_ids for i in idx],
                       "sampling_params": [requests[i].sampling.to_sglang() for i in idx],
                       "return_logprob": True, "rid": [rids[i] for i in idx]}
            outs = await client.generate(payload)
            if not isinstance(outs, list) or len(outs) != len(idx):
                raise ValueError(f"{client.url}/generate: expected {len(idx)} answers, got {type(outs).__name__} "
                                 f"{len(outs) if isinstance(outs, list) else ''}")
            return outs

        async def run():
            return await asyncio.gather(*(one(c, idx) for c, idx in zip(targets, chunks)))

        out: list[Optional[Completion]] = [None] * len(requests)
        for (idx, outs), target in zip(zip(chunks, self._call(run())), targets):
            for i, o in zip(idx, outs):
                c = completion_from_output(o, f"{target.url}/generate")
                c.rid = requests[i].rid
                out[i] = c
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> int:
        versions = self._all(lambda c: c.get_weight_version())
        if len(set(versions)) != 1:
            raise EngineStateError("engines serve different weight versions: "
                                   + ", ".join(f"{c.url}={v}" for c, v in zip(self.clients, versions)))
        return versions[0]

    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        if "weights" in self._released:
            raise EngineStateError("update_weights called while the engine weights are released; resume 'weights' first")
        if self.transport == "disk":
            return self._update_from_disk(buckets, version)
        self._all(lambda c: c.begin_weight_update())
        try:
            if self.transport == "nccl":
                self._update_distributed(buckets, version)
            else:
                self._update_from_tensor(buckets, version)
        finally:
            self._all(lambda c: c.end_weight_update())

    def _update_from_tensor(self, buckets, version: int) -> None:
        inflight: Optional[tuple] = None
        sent = False
        for bucket, last in _lookahead(buckets):
            if self.transport == "ipc" and not bucket[0][1].is_cuda:
                raise ValueError("sync.transport 'ipc' needs CUDA tensors; the trainer's are on "
                                 f"{bucket[0][1].device} (use 'shm' or 'auto')")
            flat, metas = wire.flatten(bucket, to_cpu=self.transport == "shm")

            async def send(flat=flat, metas=metas, last=last):
                await asyncio.gather(*(c.update_weights_from_tensor(
                    [wire.flattened_bucket_payload(flat, metas) for _ in range(tp)], load_format=wire.FLATTENED_BUCKET,
                    flush_cache=last, weight_version=str(version) if last else None)
                    for c, tp in zip(self.clients, self.tp_sizes)))

            fut = self._submit(send())
            if inflight is not None:
                inflight[0].result()
            inflight = (fut, flat)  # the buffer stays alive until its request is answered
            sent = True
        if inflight is not None:
            inflight[0].result()
        if not sent:
            self._all(lambda c: c.update_weight_version(str(version)))

    def _ensure_group(self, device: torch.device) -> None:
        if self._pg is not None:
            return
        from megaforge.rollout import weight_group
        from megaforge.rollout.launcher import connect_host, free_port

        hosts = {c.url.split("//", 1)[1].rsplit(":", 1)[0] for c in self.clients}
        local = all(connect_host(h.strip("[]")) in ("127.0.0.1", "::1", "localhost") for h in hosts)
        addr = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
        port = free_port(addr)
        world = 1 + sum(self.tp_sizes)
        backend = "nccl" if device.type == "cuda" else "gloo"
        offsets = [1 + sum(self.tp_sizes[:k]) for k in range(len(self.clients))]

        async def join():
            return await asyncio.gather(*(c.init_weights_update_group(addr, port, off, world, self.group_name, backend)
                                          for c, off in zip(self.clients, offsets)))

        fut = self._submit(join())
        try:
            pg = weight_group.init_custom_process_group(backend, addr, port, world, 0, self.group_name,
                                                        timeout_s=min(self.timeout_s, 600.0))
        except Exception as e:
            try:
                fut.result(timeout=5.0)
                why = ""
            except Exception as fe:  # noqa: BLE001
                why = f"; an engine said: {fe}"
            raise EngineStateError(f"weight-update group ({backend}, {addr}:{port}, world {world}) failed: {e}{why}") from e
        fut.result()
        self._pg = pg

    def _update_distributed(self, buckets, version: int) -> None:
        import torch.distributed as dist

        for bucket, last in _lookahead(buckets):
            named = wire.packing_order(bucket)
            self._ensure_group(named[0][1].device)
            flat, metas = wire.flatten(named, shared=False)
            fut = self._submit(_gather([c.update_weights_from_distributed(
                [m.name for m in metas], [str(m.dtype).removeprefix("torch.") for m in metas],
                [list(m.shape) for m in metas], group_name=self.group_name, flush_cache=last,
                weight_version=str(version) if last else None, load_format=wire.FLATTENED_BUCKET)
                for c in self.clients]))
            work = dist.broadcast(flat, src=0, group=self._pg, async_op=True)
            while not work.is_completed():  # an engine that refuses the bucket never joins: fail, not hang
                if fut.done() and fut.exception() is not None:
                    self._pg = None
                    raise EngineStateError(f"an engine refused a distributed weight bucket: {fut.exception()}")
                time.sleep(0.002)
            work.wait()
            fut.result()

    def _update_from_disk(self, buckets, version: int) -> None:
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
        raise NotImplementedError("sync.check_equal reads the engine's tensors in-process: it needs rollout.engine: embedded")

    # ------------------------------------------------------------------------------------- memory
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        todo = [t for t in check_tags(tags) if t not in self._released]
        if todo:
            self._all(lambda c: c.release_memory_occupation(todo))
            self._released |= set(todo)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        todo = [t for t in check_tags(tags) if t in self._released]
        if todo:
            self._all(lambda c: c.resume_memory_occupation(todo))
            self._released -= set(todo)

    @property
    def released(self) -> set[str]:
        return set(self._released)

    # ------------------------------------------------------------------------------ health, abort
    def health(self) -> bool:
        return all(self._all(lambda c: c.health_generate()))

    def restart_server(self, k: int, timeout_s: float = 600.0) -> None:
        """Restart engine ``k`` (one this engine launched), e.g. after a failed health check. It comes
        back with its initial weights and version 0, memory resident: the caller re-syncs weights."""
        proc = next((p for p in self.processes if p.name == f"engine_{k}"), None)
        if proc is None:
            raise ValueError(f"engine {k} was not launched by this HTTPEngine; it cannot restart it")
        old = self.clients[k]
        proc.restart(timeout_s)
        self._call(old.close())
        self.clients[k] = SGLangClient(proc.url, old.api_key, old.timeout_s, old.max_concurrency)
        if self._pg is not None:  # the group lost a member: dropped everywhere, rebuilt on the next update
            from megaforge.rollout import weight_group

            others = [c for i, c in enumerate(self.clients) if i != k]
            self._call(_gather([c.destroy_weights_update_group(self.group_name) for c in others], return_exceptions=True))
            weight_group.destroy(self._pg)
            self._pg = None
        if self._released:  # keep one memory state across engines
            self._call(self.clients[k].release_memory_occupation(sorted(self._released)))

    def abort(self) -> None:
        self._all(lambda c: c.abort_request(abort_all=True))

    def flush_cache(self) -> None:
        self._all(lambda c: c.flush_cache())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._pg is not None:
                from megaforge.rollout import weight_group

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



# ------------------------------------------------------------------------------------- launching
SGLANG_TESTED = {"sglang": "0.5.23", "sglang-router": "0.3.2"}


def require_sglang(router: bool = False) -> None:
    """Fail early, naming the extra to install, when the sglang packages are missing."""
    import importlib.metadata
    import importlib.util
    import warnings

    from megaforge.configtree import ConfigError

    need = [("sglang", "sglang")] + ([("sglang-router", "sglang_router")] if router else [])
    missing = [pkg for pkg, mod in need if importlib.util.find_spec(mod) is None]
    if missing:
        pins = ", ".join(f"{k}=={v}" for k, v in SGLANG_TESTED.items())
        raise ConfigError(f"rollout.engine 'sglang'{' with rollout.router' if router else ''} needs {', '.join(missing)}, "
                          f"which is not installed: pip install 'megaforge[sglang]' (tested with {pins})")
    for pkg, _ in need:
        v = importlib.metadata.version(pkg)
        if v != SGLANG_TESTED[pkg]:
            warnings.warn(f"{pkg} {v} is installed; megaforge is tested with {pkg}=={SGLANG_TESTED[pkg]}")


def gpu_assignment(num_engines: int, tp: int, num_gpus: int, local_world: int, visible: Optional[list[int]]) -> list[list[int]]:
    """GPU ids (as the parent sees them, mapped through its CUDA_VISIBLE_DEVICES) of each engine.

    Colocated (``num_gpus == 0``): engines share the trainer's GPUs, engine k on GPUs
    ``[k*tp, (k+1)*tp)``. Disaggregated: the last ``num_gpus`` GPUs of the node are the rollout GPUs
    (the placement :mod:`megaforge.planner.layout` reports); they must not overlap the trainer's
    ``local_world`` ones. All engines run on this (the main rank's) node.
    """
    need = num_engines * tp
    if num_gpus and need > num_gpus:
        raise ValueError(f"rollout.num_engines x rollout.tensor_parallel = {need} GPUs > rollout.num_gpus = {num_gpus}")
    base = 0 if num_gpus == 0 else (len(visible) - num_gpus if visible is not None else local_world)
    if num_gpus and base < local_world:
        raise ValueError(f"rollout.num_gpus = {num_gpus} rollout GPUs and {local_world} trainer processes do not fit "
                         f"the {len(visible) if visible is not None else '?'} GPUs of this node")
    if visible is not None and base + need > len(visible):
        raise ValueError(f"rollout engines need GPUs {base}..{base + need - 1} but only {len(visible)} are visible")
    ids = visible if visible is not None else list(range(base + need))
    return [ids[base + k * tp: base + (k + 1) * tp] for k in range(num_engines)]


def _visible_gpus() -> Optional[list[int]]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [int(x) for x in env.split(",") if x.strip()]
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else None


def _model_dir(cfg) -> tuple[str, list[str]]:
    """The policy's initial weights as a folder the servers can load (a random init is written out)."""
    if cfg.model.path:
        return cfg.model.path, []
    from megaforge.hf import load_hf_model

    d = tempfile.mkdtemp(prefix="megaforge-engine-init-")
    load_hf_model(cfg.model, torch.device("cpu")).save_pretrained(d)
    return d, [d]


def build_http_engine(cfg, tokenizer, kind: str) -> HTTPEngine:
    """Launch ``rollout.num_engines`` servers of ``kind`` (``embedded_server`` | ``sglang``), wait until
    they are ready, optionally put the router in front; logs in ``<run dir>/logs/engine_K.log``."""
    from megaforge.hf import resolve_device
    from megaforge.rollout.launcher import ServerProcess, child_env, start_all
    from megaforge.rollout.server import API_KEY_ENV, is_loopback, new_api_key

    r = cfg.rollout
    if kind == "sglang":
        require_sglang(router=r.router and r.num_engines > 1)
    elif r.tensor_parallel != 1:
        raise ValueError("rollout.tensor_parallel: the embedded server runs TP 1 (use rollout.num_engines)")
    elif r.router and r.num_engines > 1:
        require_sglang(router=True)
    api_key = r.api_key or ("" if is_loopback(r.host) else new_api_key())
    model_dir, cleanup = _model_dir(cfg)
    tok_dir = cfg.model.tokenizer or cfg.model.path or ""
    local = lambda p: os.path.abspath(p) if p and os.path.exists(p) else p  # noqa: E731  (hub ids stay)
    model_dir, tok_dir = local(model_dir), local(tok_dir)
    logs = os.path.join(cfg.run_dir, "logs")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = resolve_device(r.device) if kind == "embedded_server" else torch.device("cuda")
    gpus = gpu_assignment(r.num_engines, r.tensor_parallel, r.num_gpus, local_world, _visible_gpus()) \
        if device.type == "cuda" else [None] * r.num_engines
    servers = []
    for k in range(r.num_engines):
        if kind == "embedded_server":
            def cmd(port, fd, k=k):
                c = [sys.executable, "-m", "megaforge.rollout.server", "--model", model_dir, "--host", r.host,
                     "--port", str(port), "--sock-fd", str(fd), "--device", "cuda" if device.type == "cuda" else "cpu",
                     "--dtype", cfg.model.dtype, "--attn-implementation", cfg.model.attn_implementation,
                     "--max-batch", str(r.engine_batch_size), "--weight-version", "0"]
                return c + (["--tokenizer", tok_dir] if tok_dir else []) + list(r.extra_args)
            env = child_env(gpus[k], {API_KEY_ENV: api_key} if api_key else None)
        else:
            def cmd(port, fd, k=k):
                c = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", r.host,
                     "--port", str(port), "--tp-size", str(r.tensor_parallel), "--mem-fraction-static", str(r.mem_fraction),
                     "--dtype", cfg.model.dtype, "--weight-version", "0", "--random-seed", str(cfg.seed)]
                c += ["--tokenizer-path", tok_dir] if tok_dir else []
                c += ["--enable-memory-saver"] if r.num_gpus == 0 else []
                c += ["--api-key", api_key] if api_key else []
                return c + list(r.extra_args)
            env = child_env(gpus[k])
        servers.append(ServerProcess(f"engine_{k}", cmd, os.path.join(logs, f"engine_{k}.log"), host=r.host, env=env,
                                     hold_socket=kind == "embedded_server", api_key=api_key))
    try:
        start_all(servers, r.startup_timeout_s)
        router_url = None
        if r.router and r.num_engines > 1:
            urls = [s.url for s in servers]
            router = ServerProcess("router", lambda port, fd: [
                sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--host", "127.0.0.1",
                "--port", str(port)] + (["--api-key", api_key] if api_key else []),
                os.path.join(logs, "router.log"), env=child_env(), api_key=api_key, probe="/health")
            router.start_ready(r.startup_timeout_s)
            servers.append(router)
            router_url = router.url
    except BaseException:
        for s in servers:
            s.stop(grace_s=3.0)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
        raise
    engines = [s for s in servers if s.name.startswith("engine_")]
    return HTTPEngine([s.url for s in engines], api_key, router_url, r.request_timeout_s, cfg.sync.transport,
                      [r.tensor_parallel] * len(engines), servers, model_dir, cleanup)
