"""Serve a megaforge reward over HTTP, so that it can run on another machine:

    python -m megaforge.rewards.serve --fn math
    python -m megaforge.rewards.serve --fn my_pkg.rewards:judge --kwargs '{strict: true}' --port 8000
    python -m megaforge.rewards.serve --spec '{name: reward_model, reward_model: {path: /ckpt/rm, device: cuda:0}}'
    python -m megaforge.rewards.serve --fn math --host 0.0.0.0 --api-key-env REWARD_TOKEN

and point a run at it with ``rewards.functions: [{name: remote, url: http://HOST:PORT/}]``.

``--fn`` is a registered reward name (``math``, ``thinking``, one registered by a ``--plugins``
module) or ``package.module:callable``; ``--spec`` is a whole ``rewards.functions`` entry (YAML),
for rewards configured by typed keys (``reward_model``, ``llm_judge``). The reward is built once.

Protocol (:mod:`megaforge.rewards.remote`): ``POST /`` with ``{prompt, response, label}`` answers
``{"reward": x}`` (HTTP 500 ``{"error": ...}`` when the reward fails on it); with a JSON list of such
objects it answers a list as long of ``{"reward": x}`` or ``{"error": ...}`` entries (a batched
reward, e.g. a reward model, scores the list in batches of its ``batch_size``). ``GET /health``
answers ``{"status": "ok", "reward": <name>}`` (HTTP 503 ``{"status": "broken", "error": ...}`` once
its workers cannot be replaced, e.g. a reward whose build crashes).

Requests are checked: a body that is not JSON, nested deeper than ``MAX_DEPTH`` (64) levels, not an
object or a list, over ``--max-batch`` entries, or whose entry lacks a string ``prompt`` /
``response`` answers HTTP 400 ``{"error": message, "field": <the field, e.g. "body[3].response">}``;
a body over ``--max-body-mb`` answers 413. The server binds 127.0.0.1 unless ``--host`` says
otherwise; beyond loopback it needs a bearer token (``--api-key`` or, kept out of the process list,
``--api-key-env NAME``), checked on every POST (401 otherwise, also for a token that is not ASCII).

Every grade has a deadline: the reward runs in ``--workers`` worker processes
(:class:`megaforge.rewards.executor.RewardExecutor`, as in a run), and a sample not scored within
``--timeout-s`` of its start answers ``{"error": "no result within ..."}`` (HTTP 500 in the single
form) while its worker is killed with its process tree and replaced. The event loop only waits,
so ``/health`` answers while grades run, and SIGTERM / SIGINT stop the server at once (the workers
are killed, requests in flight answered 500 or dropped). A reward value must be a real finite
number (:mod:`megaforge.rewards.values`).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
from typing import Optional

from megaforge.config import RewardSpec, config_from_dict
from megaforge.net import is_loopback
from megaforge.rewards.build import REWARDS, build_reward, own_workers, reward_level
from megaforge.rewards.executor import RewardCall, RewardExecutor

log = logging.getLogger("megaforge.rewards.serve")


class FieldError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


MAX_DEPTH = 64


def _depth_over(data, limit: int) -> bool:
    """Whether JSON ``data`` nests lists / objects more than ``limit`` levels (iterative)."""
    todo = [(data, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, dict)):
            if d > limit:
                return True
            todo += [(v, d + 1) for v in (x.values() if isinstance(x, dict) else x)]
    return False


def parse_items(body: bytes, max_batch: int) -> tuple[list[dict], bool]:
    """The request's samples and whether it was the batched form; FieldError naming the field."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise FieldError("body", f"body: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise FieldError("body", f"body: not JSON: {e}") from None
    if _depth_over(data, MAX_DEPTH):
        raise FieldError("body", f"body: nested deeper than {MAX_DEPTH} levels")
    batched = isinstance(data, list)
    if not batched and not isinstance(data, dict):
        raise FieldError("body", f"body: expected an object {{prompt, response, label}} or a list of them, "
                                 f"got {type(data).__name__}")
    items = data if batched else [data]
    if len(items) > max_batch:
        raise FieldError("body", f"body: {len(items)} samples in one request > --max-batch {max_batch}")
    for k, item in enumerate(items):
        where = f"body[{k}]" if batched else "body"
        if not isinstance(item, dict):
            raise FieldError(where, f"{where}: expected an object {{prompt, response, label}}, got {type(item).__name__}")
        for key in ("prompt", "response"):
            if not isinstance(item.get(key), str):
                got = "missing" if key not in item else f"a {type(item[key]).__name__}"
                raise FieldError(f"{where}.{key}", f"{where}.{key}: must be a string ({got})")
    return items, batched


def score_items(executor: RewardExecutor, items: list[dict]) -> list[dict]:
    """``{"reward": x}`` or ``{"error": message}`` per item, scored by the executor's workers
    (blocking: called off the event loop)."""
    ids = executor.submit([RewardCall(0, i["prompt"], i["response"], i.get("label")) for i in items])
    return [{"reward": o.value} if o.ok else {"error": o.error} for o in executor.collect(ids)]


def build_app(executor: RewardExecutor, name: str, api_key: str = "", max_body: int = 16 << 20,
              max_batch: int = 1024):
    from aiohttp import web

    def error(status: int, message: str, field: Optional[str] = None):
        return web.json_response({"error": message, **({"field": field} if field else {})}, status=status)

    @web.middleware
    async def guard(request, handler):
        if api_key and request.method == "POST":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if not token.isascii():  # undecodable bytes arrive as surrogates
                log.warning("401 %s %s from %s: a token that is not ASCII", request.method, request.path,
                            request.remote)
                return error(401, "Unauthorized: the bearer token must be ASCII")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
                log.warning("401 %s %s from %s", request.method, request.path, request.remote)
                return error(401, "Unauthorized: send Authorization: Bearer <token>")
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"body: larger than --max-body-mb ({max_body / (1 << 20):g} MiB)", "body")

    async def reward(request):
        body = await request.read()
        try:
            items, batched = parse_items(body, max_batch)
        except FieldError as e:
            return error(400, str(e), e.field)
        try:
            answers = await asyncio.get_running_loop().run_in_executor(None, score_items, executor, items)
        except RuntimeError as e:  # the executor closed (shutting down) or broke
            return error(500, str(e))
        if batched:
            return web.json_response(answers)
        if "error" in answers[0]:
            return error(500, answers[0]["error"])
        return web.json_response(answers[0])

    async def health(request):
        if executor.broken:
            return web.json_response({"status": "broken", "reward": name, "error": executor.broken}, status=503)
        return web.json_response({"status": "ok", "reward": name})

    app = web.Application(middlewares=[guard], client_max_size=max_body)
    app.router.add_post("/", reward)
    app.router.add_get("/health", health)
    return app


def build_from_args(args) -> tuple[RewardExecutor, str]:
    """(the reward's worker pool, its name) from --fn / --kwargs or --spec."""
    import yaml

    plugins = [m for m in (args.plugins or "").split(",") if m]
    for mod in plugins:
        importlib.import_module(mod)
    if bool(args.fn) == bool(args.spec):
        raise SystemExit("serve: give one of --fn NAME and --spec YAML")
    if args.spec:
        data = yaml.safe_load(args.spec)
        if not isinstance(data, dict):
            raise SystemExit(f"serve: --spec must be a YAML mapping (a rewards.functions entry), got {args.spec!r}")
        spec = config_from_dict(data, RewardSpec)
    else:
        kwargs = yaml.safe_load(args.kwargs) if args.kwargs else {}
        if not isinstance(kwargs, dict):
            raise SystemExit(f"serve: --kwargs must be a YAML mapping, got {args.kwargs!r}")
        spec = RewardSpec(args.fn, kwargs=kwargs)
    if spec.name == "remote":
        raise SystemExit("serve: a remote reward is served where it runs, not proxied")
    try:
        REWARDS.get(spec.name)
        if reward_level(spec) != "sample":
            raise ValueError(f"reward {spec.name!r} is group-level: the service scores single samples")
    except ValueError as e:
        raise SystemExit(f"serve: {e}") from None
    workers = own_workers(spec) or args.workers
    try:
        executor = RewardExecutor(build_reward, [spec], workers, args.timeout_s, plugins=plugins,
                                  start_timeout_s=args.start_timeout_s, spares=own_workers(spec) is None,
                                  timeout_key="--timeout-s")
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"serve: {e}") from None
    return executor, spec.name


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megaforge.rewards.serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fn", help="registered reward name (math, thinking, ...) or package.module:callable")
    ap.add_argument("--kwargs", help="constructor arguments of --fn (YAML mapping)")
    ap.add_argument("--spec", help="a whole rewards.functions entry (YAML mapping), e.g. for reward_model")
    ap.add_argument("--plugins", help="comma-separated modules to import first (they register rewards)")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (0: a free one; the URL is printed)")
    ap.add_argument("--api-key", default="", help="bearer token required on POST (visible in the process list)")
    ap.add_argument("--api-key-env", default="", help="environment variable holding the bearer token")
    ap.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body (MiB)")
    ap.add_argument("--max-batch", type=int, default=1024, help="most samples in one batched request")
    ap.add_argument("--workers", type=int, default=2, help="reward worker processes (a reward model or judge: 1)")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="seconds one sample's grade may run (> 0)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0, help="seconds the workers get to build the reward")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[megaforge.rewards.serve] %(message)s")
    key = args.api_key
    if args.api_key_env:
        key = os.environ.get(args.api_key_env, "")
        if not key:
            raise SystemExit(f"serve: --api-key-env {args.api_key_env}: the variable is not set (or empty)")
    if not is_loopback(args.host) and not key:
        raise SystemExit(f"serve: --host {args.host} exposes the reward beyond this machine: give --api-key or "
                         f"--api-key-env")
    if args.workers < 1 or not args.timeout_s > 0:
        raise SystemExit(f"serve: --workers must be >= 1 and --timeout-s > 0 (got {args.workers}, {args.timeout_s})")
    executor, name = build_from_args(args)
    try:
        asyncio.run(_serve(build_app(executor, name, key, int(args.max_body_mb * (1 << 20)), args.max_batch),
                           executor, name, args.host, args.port))
    finally:
        executor.close()


async def _serve(app, executor: RewardExecutor, name: str, host: str, port: int) -> None:
    from aiohttp import web

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    shown = f"[{host}]" if ":" in host else host
    print(f"[megaforge] serving reward {name!r} on http://{shown}:{sock.getsockname()[1]}/", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.get_running_loop().run_in_executor(None, executor.close)  # kills the grades in flight
    await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
