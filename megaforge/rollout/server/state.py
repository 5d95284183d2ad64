"""The embedded server's state around one EmbeddedEngine (:class:`Server`): requests checked and turned
into the engine's, queued / running / aborted requests, memory tags, weight-update session and groups,
health. Engine work runs on one worker thread, weight-group set-up on another, the decoding of
``/update_weights_from_tensor`` payloads on a third (a large or hostile payload does not hold generation).

Abandoned requests: while a request waits for the engine its client's connection is watched
(:meth:`Server.generate`'s ``gone``); once the client has left, its queued requests are dropped before they
start and, when its batch is the one the engine is running, the engine aborts it (the engine thread runs
one HTTP request's batch at a time, so this aborts no other client's requests).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from megaforge import __version__
from megaforge.rollout import context_limit
from megaforge.rollout.http import protocol as P
from megaforge.rollout.http.protocol import MEMORY_TAGS, StateError, finish_reason_json
from megaforge.rollout.routing import encode as encode_routing
from megaforge.rollout.server.limits import max_text_bytes
from megaforge.types import Completion, GenerateRequest, SamplingParams

WATCH_S = 0.1  # how often a waiting request checks whether its client has left


class Server:
    """The endpoints' state around one EmbeddedEngine. Engine work runs on one worker thread."""

    def __init__(self, args, engine, tokenizer, eos_ids: list[int], host: str, port: int, token_bytes: int = 1):
        self.args, self.engine, self.tokenizer, self.eos_ids = args, engine, tokenizer, list(eos_ids)
        self.host, self.port = host, port
        self.version = args.weight_version
        self.context = context_limit(engine.model.config) or 2048  # SGLang's default without a length key
        self.max_text_bytes = max_text_bytes(self.context, token_bytes)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.dist_pool = ThreadPoolExecutor(1, thread_name_prefix="dist-setup")  # group set-up: off the engine thread
        self.decode_pool = ThreadPoolExecutor(1, thread_name_prefix="decode")  # weight payloads: off the engine thread
        self._job_lock = threading.Lock()  # guards _current_job and aborted_rids between the loop and the engine thread
        self._current_job: object = None  # the rid tuple of the batch on the engine thread
        self.abandoned = 0  # requests dropped or aborted because their client left
        self.body_readers = 0  # requests reading their body now (megaforge.rollout.server.routes)
        self.refused_body_readers = 0
        self._health_job = None  # the 1-token generation of /health_generate, while it is pending
        self.guard = None  # the ConnectionGuard, once serving
        self.released: set[str] = set()
        self.session_open = False
        self.needs_session = self.args.sglang_api != "0.5.16"  # SGLang >= 0.5.21 (megaforge.rollout.http.versions)
        self.groups: dict = {}
        self.queued: dict[str, int] = {}  # rid -> abort epoch at submission (not started yet)
        self.running: set[str] = set()
        self.aborted_rids: set[str] = set()
        self.epoch = 0
        self.served = 0  # requests generated to completion (stop/length) since start
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.started = time.time()

    async def run(self, fn, *a):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *a)

    async def run_decode(self, fn, *a):
        """``fn`` on the payload-decoding thread (one at a time: a decode's memory is bounded once)."""
        return await asyncio.get_running_loop().run_in_executor(self.decode_pool, fn, *a)

    async def run_dist_setup(self, fn, *a):
        """``fn`` on the weight-group set-up thread: a rendezvous that waits does not hold the engine."""
        return await asyncio.get_running_loop().run_in_executor(self.dist_pool, fn, *a)

    @property
    def busy(self) -> int:
        return len(self.queued) + len(self.running)

    # ------------------------------------------------------------------------------------ generate
    async def _prompts(self, body: dict) -> tuple[list[list[int]], bool, str]:
        """(token ids of every prompt, single, the field they came from); each checked against the
        vocabulary and the context."""
        if (body["text"] is None) == (body["input_ids"] is None):
            raise P.FieldError("input_ids", "give exactly one of `input_ids` and `text`")
        if body["stream"]:
            raise P.FieldError("stream", "streaming is not supported by megaforge's embedded server")
        if body["input_ids"] is not None:
            single = not isinstance(body["input_ids"][0], list)
            prompts = [body["input_ids"]] if single else body["input_ids"]
            field = "input_ids"
        else:
            if self.tokenizer is None:
                raise P.FieldError("text", "this server has no tokenizer; send input_ids")
            single = isinstance(body["text"], str)
            texts = [body["text"]] if single else body["text"]
            for i, t in enumerate(texts):  # refused before tokenizing: it cannot fit the context
                nbytes = len(t.encode("utf-8", "surrogatepass"))
                if nbytes > self.max_text_bytes:
                    least = -(-nbytes // (self.max_text_bytes // self.context))
                    raise P.LengthError(("" if single else f"text[{i}]: ") + f"The input (at least {least} tokens: "
                                        f"{nbytes} bytes of text) is longer than the model's context length "
                                        f"({self.context} tokens).")
            loop = asyncio.get_running_loop()  # tokenizing a long text must not hold the event loop
            try:
                prompts = await loop.run_in_executor(None, lambda: [self.tokenizer(t)["input_ids"] for t in texts])
            except (TypeError, ValueError, UnicodeError) as e:
                raise P.FieldError("text", f"cannot be tokenized: {type(e).__name__}: {e}") from None
            field = "text"
        vocab = self.engine.model.config.vocab_size
        for i, ids in enumerate(prompts):
            where = field if single else f"{field}[{i}]"
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad or not ids:
                raise P.FieldError(where, f"token ids must be in [0, {vocab}) and non-empty (got {bad[:3] or 'none'})")
            if len(ids) >= self.context:
                raise P.LengthError(("" if single else f"{where}: ") + P.input_too_long(len(ids), self.context))
        return prompts, single, field

    async def requests_of(self, body: dict) -> tuple[list, bool]:
        prompts, single, field = await self._prompts(body)
        n = len(prompts)
        vocab = self.engine.model.config.vocab_size

        def per_item(name, default):
            v = body[name]
            if isinstance(v, list):
                if single or len(v) != n:
                    raise P.FieldError(name, f"an array here needs a batch of the same length ({n} prompts)")
                return v
            return [default if v is None else v] * n

        rid = body["rid"]
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(rid, str):
            rids = [rid] if single else [f"{rid}_{i}" for i in range(n)]
        else:
            rids = per_item("rid", None)
        for name, ok in (("logprob_start_len", (-1,)), ("top_logprobs_num", (0,))):
            for i, v in enumerate(per_item(name, ok[0])):
                if v not in ok:
                    raise P.FieldError(name if single else f"{name}[{i}]", f"only {ok[0]} is supported by megaforge's embedded server")
        if len(set(rids)) != len(rids):
            raise P.FieldError("rid", "request ids must be unique within a batch")
        if body["routed_experts_start_len"] != 0:
            raise P.FieldError("routed_experts_start_len", "only 0 (the whole sequence) is supported by megaforge's "
                                                           "embedded server")
        routed = body["return_routed_experts"]
        if routed and self.engine.routing_layers() is None:
            raise P.FieldError("return_routed_experts", "the served model has no mixture-of-experts layers")
        sps = per_item("sampling_params", {})
        reqs, shown = [], []
        for i, sp in enumerate(sps):
            s = P.validate_sampling(sp, "sampling_params" if not isinstance(body["sampling_params"], list) else f"sampling_params[{i}]")
            if len(prompts[i]) + s["max_new_tokens"] > self.context:  # as SGLang: refused, not cut
                raise P.LengthError(("" if single else f"{field}[{i}]: ")
                                    + P.total_too_long(len(prompts[i]), s["max_new_tokens"], self.context))
            stop_ids = [] if s["ignore_eos"] else sorted(set(s["stop_token_ids"] or []) | set(self.eos_ids))
            stop = [s["stop"]] if isinstance(s["stop"], str) else list(s["stop"] or [])
            if stop and self.tokenizer is None:
                raise P.FieldError(f"sampling_params.stop", "stop strings need the server's tokenizer")
            top_k = s["top_k"] if 0 < s["top_k"] < vocab else -1
            reqs.append(GenerateRequest(list(prompts[i]), SamplingParams(
                temperature=s["temperature"], top_p=s["top_p"], top_k=top_k, max_new_tokens=s["max_new_tokens"],
                stop_token_ids=stop_ids, stop=stop, seed=s["sampling_seed"]), rid=rids[i], return_routed_experts=routed))
            shown.append(s)
        return list(zip(reqs, shown, per_item("return_logprob", False))), single

    def _generate_job(self, items: list, epoch: int) -> tuple[list, str]:
        """Worker thread: (completions, the weight version they were generated with)."""

        version = self.version  # weight updates run on this same thread: stable for the job
        job = tuple(r.rid for r, _, _ in items)
        with self._job_lock:
            for rid in job:
                self.queued.pop(rid, None)
            self._current_job = job
        try:
            if epoch != self.epoch:  # abort_all / pause(abort) came while queued
                return [Completion(r.rid, [], [], "abort", 0, "") for r, _, _ in items], version
            todo = [r for r, _, _ in items if r.rid not in self.aborted_rids]
            self.running.update(r.rid for r in todo)
            try:
                if self.args.generate_delay > 0 and todo:
                    time.sleep(self.args.generate_delay)
                with self._job_lock:  # an abort_all or a client that left during the delay
                    go = [r for r in todo if r.rid not in self.aborted_rids] if epoch == self.epoch else []
                done = {c.rid: c for c in self.engine.generate(go)} if go else {}
            finally:
                self.running.difference_update(r.rid for r in todo)
        finally:
            with self._job_lock:
                self._current_job = None
                self.aborted_rids.difference_update(job)
        self.served += sum(c.finish_reason != "abort" for c in done.values())
        return [done.get(r.rid) or Completion(r.rid, [], [], "abort", 0, "") for r, _, _ in items], version

    def abandon(self, rids: tuple) -> None:
        """The client of the batch ``rids`` has left: drop it if queued, abort the engine if it is running
        (idempotent; called again until the batch is done, as the engine clears an abort as it starts)."""
        with self._job_lock:
            new = [r for r in rids if r not in self.aborted_rids]
            self.aborted_rids.update(rids)
            if self._current_job == rids:
                self.engine.abort()
        if new:
            self.abandoned += len(new)

    def _answer(self, req, sp: dict, want_lp: bool, c, version: str) -> dict:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(c.output_ids, skip_special_tokens=sp["skip_special_tokens"])
            if not sp["no_stop_trim"] and c.finish_reason == "stop":
                for s in req.sampling.stop:
                    if s in text:
                        text = text[: text.index(s)]
                        break
        meta = {"id": req.rid, "finish_reason": finish_reason_json(c.finish_reason, c.output_ids, req.sampling.stop_token_ids,
                                                                  req.sampling.stop, text),
                "prompt_tokens": len(req.input_ids), "completion_tokens": len(c.output_ids), "cached_tokens": 0,
                "weight_version": version}
        if want_lp:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.output_logprobs, c.output_ids)]
        if req.return_routed_experts and c.routed_experts is not None:  # as sglang: base64 of int32 [n, L, K]
            meta["routed_experts"] = encode_routing(c.routed_experts)
        return {"text": text, "output_ids": list(c.output_ids), "meta_info": meta}

    async def generate(self, body: dict, gone=None):
        """The answers of a native ``/generate`` body; ``gone()`` (optional) says whether the client has
        left, polled every :data:`WATCH_S` while the batch waits or runs (then :meth:`abandon`)."""
        items, single = await self.requests_of(body)
        return await self.generate_items(items, single, gone)

    async def generate_items(self, items: list, single: bool, gone=None):
        await self.unpaused.wait()
        if self.released & {"weights", "kv_cache"}:
            raise StateError(f"cannot generate: memory is released ({sorted(self.released)}); "
                             f"call /resume_memory_occupation first")
        rids = tuple(r.rid for r, _, _ in items)
        for r, _, _ in items:
            self.queued[r.rid] = self.epoch
        try:
            job = asyncio.ensure_future(self.run(self._generate_job, items, self.epoch))
            while True:
                done, _ = await asyncio.wait({job}, timeout=WATCH_S if gone is not None else None)
                if done:
                    break
                if gone():
                    self.abandon(rids)
            comps, version = job.result()
        finally:
            for r, _, _ in items:
                self.queued.pop(r.rid, None)
        out = [self._answer(r, sp, lp, c, version) for (r, sp, lp), c in zip(items, comps)]
        return out[0] if single else out

    # ------------------------------------------------------------------------------------ control
    def abort_all(self) -> None:
        self.epoch += 1
        self.engine.abort()

    def abort(self, rid: str, abort_all: bool) -> None:
        if abort_all:
            self.abort_all()
        elif rid in self.running:
            raise StateError(f"request {rid!r} is running: the embedded engine aborts running requests only all "
                             f"at once (abort_all: true)")
        elif rid in self.queued:
            with self._job_lock:
                self.aborted_rids.add(rid)

    def release(self, tags) -> None:
        tags = list(tags or MEMORY_TAGS)
        if self.busy:
            raise StateError(f"release_memory_occupation needs an idle server; {self.busy} requests are running or queued")
        again = [t for t in tags if t in self.released]
        if again:
            raise StateError(f"memory tag(s) {again} already released")
        self.engine.release_memory(tags)
        self.released |= set(tags)

    def resume(self, tags) -> None:
        tags = list(tags or MEMORY_TAGS)
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise StateError(f"memory tag(s) {missing} are not released; released: {sorted(self.released)}")
        self.engine.resume_memory(tags)
        self.released -= set(tags)

    async def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.busy

    async def health_generate(self) -> tuple[bool, str]:
        """As SGLang: healthy when the engine makes a decoding step within ``--health-timeout`` seconds
        (the running requests' or, when idle, a 1-token generation's); an engine thread that is busy
        without decoding (stuck in a call, or a request that never starts) is unhealthy."""
        if self.released & {"weights", "kv_cache"}:
            return False, f"memory released: {sorted(self.released)}"

        tic = time.monotonic()
        if self._health_job is None or self._health_job.done():
            req = GenerateRequest([0], SamplingParams(temperature=0.0, max_new_tokens=1),
                                  rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
            self._health_job = asyncio.ensure_future(self.run(self.engine.generate, [req]))
            self._health_job.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: no warning
        job = self._health_job
        deadline = tic + self.args.health_timeout
        while time.monotonic() < deadline:
            if self.engine.progress_time > tic:
                return True, "ok"
            if job.done() and job.exception() is not None:
                e = job.exception()
                return False, f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.02)
        return False, (f"no decoding step in {self.args.health_timeout:g} s: the engine thread is stuck "
                       f"({len(self.running)} running, {len(self.queued)} queued requests)")

    def info(self) -> dict:
        cfg = self.engine.model.config
        return {"model_path": self.args.model, "served_model_name": self.args.model,
                "tokenizer_path": self.args.tokenizer or self.args.model, "is_generation": True,
                "weight_version": self.version, "load_format": None, "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None)}

    def server_info(self) -> dict:
        return {"host": self.host, "port": self.port, "model_path": self.args.model, "dtype": self.args.dtype,
                "device": self.args.device, "tp_size": 1, "max_batch": self.args.max_batch, "weight_version": self.version,
                "released_memory": sorted(self.released), "running_requests": len(self.running),
                "queued_requests": len(self.queued), "paused": not self.unpaused.is_set(),
                "weight_update_session": self.session_open, "weight_update_groups": sorted(self.groups),
                "startup_time": self.started, "version": __version__, "frontend": "megaforge-embedded",
                "sglang_api": self.args.sglang_api,
                "pid": os.getpid(), "served_requests": self.served, "context_length": self.context,
                "connections": self.guard.open_connections() if self.guard else 0,
                "max_connections": self.guard.max_connections if self.guard else 0,
                "evicted_connections": self.guard.evicted if self.guard else 0, "abandoned_requests": self.abandoned,
                "body_readers": self.body_readers, "refused_body_readers": self.refused_body_readers,
                "refused_connections": self.guard.refused if self.guard else 0}
