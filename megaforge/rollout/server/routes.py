"""The aiohttp routes of :mod:`megaforge.rollout.server` (:class:`Routes`): auth, body validation, errors,
weight updates.

Answers (as sglang 0.5.23): weight-update endpoints ``{"success": bool, "message": str}`` (HTTP 400
when ``success`` is false); generation and state errors ``{"error": {"message": str}}`` with HTTP
400; malformed bodies ``{"object": "error", "message", "type": "Bad Request", "param": <field>,
"code": 400}``; missing/wrong bearer token ``{"error": "Unauthorized"}`` with HTTP 401.
"""
from __future__ import annotations

import asyncio
import json
import logging

import torch
from aiohttp import web

from megaforge.net import is_loopback
from megaforge.rollout.http import protocol as P
from megaforge.rollout.http.auth import bearer_ok
from megaforge.rollout.server import weights as W
from megaforge.rollout.server.openai_api import OpenAIRoutes, openai_error
from megaforge.sync import weight_group, wire
from megaforge.sync.check import dtype_name, tensor_digest

log = logging.getLogger("megaforge.engine_server")
BODY_GRACE_S = 2.0  # how long a body may lag its head before, past --max-body-readers, it counts as trickling
NO_SESSION = "{} must run between begin_weight_update() and end_weight_update()"


def client_gone(request: web.Request) -> bool:
    """Whether the client of ``request`` has closed its connection."""
    t = request.transport
    return t is None or t.is_closing()


def _bad_request(field: str, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "Bad Request", "param": field,
                              "code": 400}, status=400)


def _failed(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


def _ok(message: str = "Success", **extra) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


class Routes:
    """The endpoints of one :class:`megaforge.rollout.server.state.Server` as aiohttp handlers (one
    method each), with the auth and error middleware (:meth:`guard`); :meth:`app` routes them."""

    def __init__(self, srv, api_key):
        self.srv, self.api_key = srv, api_key

    @web.middleware
    async def guard(self, request: web.Request, handler):
        oai = request.path.startswith("/v1/")  # OpenAI-compatible routes answer errors in OpenAI's shape
        if self.api_key and not request.path.startswith("/health"):
            if not bearer_ok(request.headers.get("Authorization", ""), self.api_key):
                log.warning("401 %s %s from %s", request.method, request.path, request.remote)
                if oai:
                    return openai_error(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                        code="invalid_api_key")
                return web.json_response({"error": "Unauthorized"}, status=401)
        if self.srv.guard is not None:
            self.srv.guard.begin(request.protocol)  # a request in progress: its connection is not idle
        try:
            return await handler(request)
        except P.FieldError as e:
            if oai:
                return openai_error(400, f"{request.path}: {e}", param=e.field)
            return _bad_request(e.field, f"{request.path}: {e}")
        except (P.StateError, P.LengthError) as e:
            if oai:
                return openai_error(400, f"{request.path}: {e}")
            return web.json_response({"error": {"message": f"{request.path}: {e}"}}, status=400)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001  (a bug: answered with its cause instead of aiohttp's bare page)
            log.exception("500 %s %s", request.method, request.path)
            message = f"{request.path}: internal error: {type(e).__name__}: {e}"
            if oai:
                return openai_error(500, message)
            return web.json_response({"error": {"message": message}}, status=500)
        finally:
            if self.srv.guard is not None:
                self.srv.guard.end(request.protocol)

    async def read_json(self, request: web.Request):
        """The request's JSON body (``{}`` when empty). A body that has not fully arrived with its head
        waits for the rest only while fewer than ``--max-body-readers`` requests do (beyond: a grace of
        ``BODY_GRACE_S``, then 503, so that connections trickling bodies cannot fill every connection
        slot), and at most ``--body-timeout`` seconds (408)."""
        if request.content.is_eof():  # the whole body arrived (or there is none): nothing to wait for
            return self.parse_json(await request.read())
        if self.srv.body_readers >= self.srv.args.max_body_readers:
            # A body sent right behind its head may not have been read when the head was (a busy machine, a
            # client sending head and body in two writes): it gets BODY_GRACE_S before it counts as trickling.
            try:
                return self.parse_json(await asyncio.wait_for(request.read(), BODY_GRACE_S))
            except asyncio.TimeoutError:
                pass
            self.srv.refused_body_readers += 1
            raise web.HTTPServiceUnavailable(text=json.dumps({"error": {"message": f"{request.path}: "
                                             f"{self.srv.body_readers} requests are sending their bodies, the most this "
                                             f"server reads at once (--max-body-readers); retry later"}}),
                                             content_type="application/json", headers={"Connection": "close"})
        self.srv.body_readers += 1
        try:
            raw = await asyncio.wait_for(request.read(), self.srv.args.body_timeout)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(text=json.dumps({"error": {"message": f"{request.path}: the request body did "
                                         f"not arrive within {self.srv.args.body_timeout:g} s"}}),
                                         content_type="application/json") from None
        finally:
            self.srv.body_readers -= 1
        return self.parse_json(raw)

    @staticmethod
    def parse_json(raw: bytes):
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except ValueError as e:
            raise P.FieldError("<body>", f"not valid JSON ({e})") from None
        except RecursionError:
            raise P.FieldError("<body>", "JSON nested too deeply") from None

    async def body(self, request: web.Request) -> dict:
        return P.validate(P.SCHEMAS[request.path], await self.read_json(request))

    def version_after(self, b: dict) -> None:
        if b.get("weight_version") is not None:
            self.srv.version = b["weight_version"]

    def flush_refused(self, b: dict):
        if b["flush_cache"] and self.srv.busy:
            return ("Weights were updated, but the cache was not flushed because requests are still running or "
                    "queued. Retract or finish them, then call /flush_cache.")
        return None

    def check_weights_resident(self, what: str) -> None:
        if "weights" in self.srv.released:
            raise P.StateError(f"{what} while the weights are released; call /resume_memory_occupation with 'weights' first")

    # ---------------------------------------------------------------------------------- generate
    async def generate(self, request):
        b = await self.body(request)
        try:
            return web.json_response(await self.srv.generate(b, gone=lambda: client_gone(request)))
        except (ValueError, RuntimeError) as e:
            if isinstance(e, (P.FieldError, P.LengthError, P.StateError)):
                raise
            return web.json_response({"error": {"message": f"/generate: {type(e).__name__}: {e}"}}, status=400)

    # ------------------------------------------------------------------------------ weight updates
    async def begin(self, request):
        await self.body(request)
        if self.srv.session_open:
            return _failed("a weight-update session is already open; call end_weight_update() first")
        self.srv.session_open = True
        return _ok()

    async def end(self, request):
        await self.body(request)
        if not self.srv.session_open:
            return _failed("no weight-update session is open; call begin_weight_update() first")
        self.srv.session_open = False
        return _ok()

    def open_update(self, b: dict, endpoint: str):
        """The start of a weight update that needs a session (SGLang 0.5.21+): abort the requests in flight
        when the body asks, then the failure answer when no session is open (None: go on)."""
        if b["abort_all_requests"]:
            self.srv.abort_all()
        if self.srv.needs_session and not self.srv.session_open:
            return _failed(NO_SESSION.format(endpoint))
        return None

    async def from_tensor(self, request):
        b = await self.body(request)
        refused = self.open_update(b, "update_weights_from_tensor")
        if refused is not None:
            return refused
        if not b["serialized_named_tensors"]:
            raise P.FieldError("serialized_named_tensors", "needs one entry per engine TP rank (this server: 1)")
        if b["load_format"] not in (None, wire.FLATTENED_BUCKET):
            raise P.FieldError("load_format", f"expected null or {wire.FLATTENED_BUCKET!r}, got {b['load_format']!r}")
        self.check_weights_resident("update_weights_from_tensor")

        def decode():  # on the decoding thread: the engine keeps generating meanwhile
            try:
                obj = wire.deserialize(b["serialized_named_tensors"][0], self.srv.args.max_bucket_mb << 20)
                return wire.named_tensors_from_payload(obj, b["load_format"])
            except ValueError as e:  # UnpicklingRefused, PayloadError, a malformed layout
                return P.FieldError("serialized_named_tensors", f"{type(e).__name__}: {e}")

        named = await self.srv.run_decode(decode)
        result = named if isinstance(named, P.FieldError) else await self.srv.run(self.load_checked, named, b)
        return self.finish("update_weights_from_tensor", b, result, f"Success: {{}} tensors loaded")

    def load_checked(self, named, b) -> object:
        """Engine thread: load ``named`` (checked first: a refused bucket changes nothing); the count,
        or the error to answer with."""
        try:
            self.srv.engine.check_specs((n, t.shape, t.dtype) for n, t in named)
        except (KeyError, ValueError) as e:
            return f"{str(e).strip(chr(39))} (no weights were changed)"
        try:
            _load(self.srv.engine, named)
        except RuntimeError as e:
            return f"{e} (the weights may be partially updated)"
        self.version_after(b)
        return len(named)

    def finish(self, what: str, b: dict, result, ok_message: str, **extra):
        if isinstance(result, P.FieldError):
            raise result
        if isinstance(result, str):
            return _failed(f"{what}: {result}; weight version stays {self.srv.version!r}")
        return _failed(self.flush_refused(b)) if self.flush_refused(b) else _ok(ok_message.format(result), **extra)

    async def from_disk(self, request):
        b = await self.body(request)
        if b["abort_all_requests"]:
            self.srv.abort_all()
        if b["load_format"] not in (None, "auto", "safetensors"):
            raise P.FieldError("load_format", f"the embedded server reads safetensors only (null, 'auto', 'safetensors'), got {b['load_format']!r}")
        self.check_weights_resident("update_weights_from_disk")
        try:
            files = W.checkpoint_files(b["model_path"], self.srv.args.weight_root, not is_loopback(self.srv.host))
        except W.WeightPathRefused as e:
            log.warning("403 /update_weights_from_disk: %s", e)
            return web.json_response({"success": False, "message": f"update_weights_from_disk: {e}"}, status=403)
        except OSError as e:
            return _failed(f"update_weights_from_disk: {e}")
        try:  # headers, names, shapes and dtypes of every file checked, then read: off the engine thread
            named = await asyncio.get_running_loop().run_in_executor(None, W.read_checkpoint, files,
                                                                     self.srv.engine.check_specs)
        except W.CheckpointError as e:
            return _failed(f"update_weights_from_disk: {e} (no weights were changed; weight version stays "
                           f"{self.srv.version!r})")
        result = await self.srv.run(self.load_checked, named, b)
        return self.finish("update_weights_from_disk", b, result, f"Succeeded to update model weights ({{}} tensors "
                           f"from {len(files)} files).", num_paused_requests=0)

    async def init_group(self, request):
        b = await self.body(request)
        if b["group_name"] == "" or b["group_name"] in self.srv.groups:
            return _failed(f"group_name {b['group_name']!r} is empty or already initialised")
        if b["backend"] == "nccl" and self.srv.engine.device.type != "cuda":
            raise P.FieldError("backend", "nccl needs a CUDA engine; this server runs on "
                                          f"{self.srv.engine.device.type}: use 'gloo'")
        if not 0 <= b["rank_offset"] < b["world_size"]:
            raise P.FieldError("rank_offset", f"must be in [0, world_size={b['world_size']})")

        def job():
            return weight_group.init_custom_process_group(b["backend"], b["master_address"], b["master_port"],
                                                          b["world_size"], b["rank_offset"], b["group_name"],
                                                          timeout_s=self.srv.args.dist_timeout,
                                                          connect_timeout_s=self.srv.args.dist_connect_timeout)

        try:  # on the set-up thread: the engine keeps generating while the rendezvous waits
            self.srv.groups[b["group_name"]] = await self.srv.run_dist_setup(job)
        except Exception as e:  # noqa: BLE001  (rendezvous failures come in many types)
            return _failed(f"Failed to initialize custom process group: {type(e).__name__}: {e}.")
        return _ok("Succeeded to initialize custom process group.")

    async def from_distributed(self, request):
        b = await self.body(request)
        refused = self.open_update(b, "update_weights_from_distributed")
        if refused is not None:
            return refused
        pg = self.srv.groups.get(b["group_name"])
        if pg is None:
            return _failed(f"Group {b['group_name']} not in {sorted(self.srv.groups)}. Please call `init_weights_update_group` first.")
        if not len(b["names"]) == len(b["dtypes"]) == len(b["shapes"]):
            raise P.FieldError("names", f"names, dtypes and shapes differ in length ({len(b['names'])}, "
                                        f"{len(b['dtypes'])}, {len(b['shapes'])})")
        if b["load_format"] not in (None, "flattened_bucket"):
            raise P.FieldError("load_format", f"expected null or 'flattened_bucket', got {b['load_format']!r}")
        dtypes = []
        for i, d in enumerate(b["dtypes"]):
            try:
                dtypes.append(weight_group.parse_dtype(d, f"dtypes[{i}]"))
            except ValueError as e:
                raise P.FieldError(f"dtypes[{i}]", str(e)) from None
        self.check_weights_resident("update_weights_from_distributed")

        def job():
            named = weight_group.receive(pg, b["names"], dtypes, b["shapes"], b["load_format"] == "flattened_bucket",
                                         self.srv.engine.device)
            _load(self.srv.engine, named)
            self.version_after(b)

        try:
            await self.srv.run(job)
        except (KeyError, ValueError, RuntimeError) as e:
            return _failed(f"Failed to update parameter online: {e}. The weights may be partially updated.")
        return _failed(self.flush_refused(b)) if self.flush_refused(b) else _ok("Succeeded to update parameter online.")

    async def destroy_group(self, request):
        b = await self.body(request)
        pg = self.srv.groups.pop(b["group_name"], None)
        if pg is None:
            return _failed(f"group_name {b['group_name']!r} is not initialised")
        await self.srv.run(weight_group.destroy, pg)
        return _ok("Succeeded to destroy custom process group.")

    async def set_version(self, request):
        b = await self.body(request)
        if b["abort_all_requests"]:
            self.srv.abort_all()

        def job():
            self.srv.version = b["new_version"]

        await self.srv.run(job)
        return _ok(f"Weight version updated to {b['new_version']}", new_version=b["new_version"])

    # ------------------------------------------------------------------------------- memory, state
    async def release(self, request):
        b = await self.body(request)
        await self.srv.run(self.srv.release, b["tags"])
        return web.json_response({"success": True, "released": sorted(self.srv.released)})

    async def resume(self, request):
        b = await self.body(request)
        await self.srv.run(self.srv.resume, b["tags"])
        return web.json_response({"success": True, "released": sorted(self.srv.released)})

    async def flush_cache(self, request):
        try:
            timeout = float(request.query.get("timeout", "0"))
        except ValueError:
            raise P.FieldError("timeout", f"query parameter must be a number, got {request.query.get('timeout')!r}") from None
        if await self.srv.flush(max(timeout, 0.0)):
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text=f"Flush cache failed: {self.srv.busy} requests are running or queued.\n")

    async def pause(self, request):
        b = await self.body(request)
        if b["mode"] != "abort":
            raise P.FieldError("mode", f"mode {b['mode']!r} is not supported by the embedded engine (it cannot suspend "
                                       f"a running batch); use 'abort'")
        self.srv.unpaused.clear()
        self.srv.abort_all()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request):
        await self.body(request)
        self.srv.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request):
        b = await self.body(request)
        self.srv.abort(b["rid"] or "", b["abort_all"])
        return web.Response(status=200)

    async def health(self, request):
        return web.Response(status=200)

    async def health_generate(self, request):
        ok, why = await self.srv.health_generate()
        return web.Response(status=200 if ok else 503, text=why)

    async def weight_version(self, request):
        return web.json_response({"weight_version": self.srv.version})

    async def weights_checksum(self, request):
        """megaforge's sync.check_equal: per-tensor dtype, shape and sha256 (megaforge.sync.check)."""
        b = await self.body(request)
        self.check_weights_resident("get_weights_checksum")

        def job():
            w = self.srv.engine.named_weights()
            missing = [n for n in (b["names"] or []) if n not in w]
            if missing:
                raise P.FieldError("names", f"the engine's model has no tensor {missing[0]!r} ({len(missing)} unknown)")
            return {n: {"dtype": dtype_name(w[n].dtype), "shape": list(w[n].shape),
                        "sha256": tensor_digest(w[n]) if b["hash"] else None} for n in (b["names"] or sorted(w))}

        return web.json_response({"success": True, "algorithm": "sha256(dtype|shape|bytes)", "tensors": await self.srv.run(job)})

    async def weights_by_name(self, request):
        """SGLang's /get_weights_by_name: the first ``truncate_size`` rows (values of a 1-D tensor) as float32."""
        b = await self.body(request)
        self.check_weights_resident("get_weights_by_name")

        def job():
            t = self.srv.engine.named_weights().get(b["name"])
            return None if t is None else t.detach().float().cpu()[: b["truncate_size"]].tolist()

        out = await self.srv.run(job)
        if out is None:
            return web.json_response({"error": {"message": f"Get parameter by name failed: no tensor {b['name']!r}"}},
                                     status=400)
        return web.json_response(out)

    async def model_info(self, request):
        return web.json_response(self.srv.info())

    async def server_info(self, request):
        return web.json_response(self.srv.server_info())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=64 << 20)
        post = [("/generate", self.generate), ("/update_weights_from_tensor", self.from_tensor),
                ("/update_weights_from_disk", self.from_disk), ("/init_weights_update_group", self.init_group),
                ("/update_weights_from_distributed", self.from_distributed),
                ("/destroy_weights_update_group", self.destroy_group), ("/update_weight_version", self.set_version),
                ("/pause_generation", self.pause), ("/continue_generation", self.cont), ("/abort_request", self.abort)]
        if self.srv.needs_session:  # the session endpoints exist from SGLang 0.5.21; /get_weight_version until 0.5.20
            post += [("/begin_weight_update", self.begin), ("/end_weight_update", self.end)]
        for path, h in post:
            app.router.add_post(path, h)
        app.router.add_put("/generate", self.generate)
        for path, h in (("/release_memory_occupation", self.release), ("/resume_memory_occupation", self.resume),
                        ("/flush_cache", self.flush_cache), ("/get_weights_checksum", self.weights_checksum),
                        ("/get_weights_by_name", self.weights_by_name)):
            app.router.add_get(path, h)
            app.router.add_post(path, h)
        get = [("/health", self.health), ("/health_generate", self.health_generate), ("/model_info", self.model_info),
               ("/get_model_info", self.model_info), ("/server_info", self.server_info),
               ("/get_server_info", self.server_info)]
        if not self.srv.needs_session:
            get += [("/get_weight_version", self.weight_version)]
        for path, h in get:
            app.router.add_get(path, h)
        OpenAIRoutes(self, client_gone).add_to(app)
        return app


def build_app(srv, api_key) -> web.Application:
    """The aiohttp application of ``srv``'s endpoints (bearer ``api_key`` when set)."""
    return Routes(srv, api_key).app()


def _load(engine, named) -> None:
    """Load ``[(name, tensor)]`` into the engine (its lock held), keeping its served version. On CUDA the
    copies are finished before the answer: the sender may rewrite a CUDA-IPC buffer once answered."""
    engine.update_weights([named], engine.weight_version)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
