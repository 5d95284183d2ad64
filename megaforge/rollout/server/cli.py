"""megaforge's embedded engine behind SGLang's native HTTP API.

    python -m megaforge.rollout.server --model DIR --port P [--host 127.0.0.1] [--api-key K]
        [--tokenizer DIR] [--device cpu] [--dtype float32] [--log-file F] [--weight-version V]
        [--generate-delay S]

The command line of the embedded server (``python -m megaforge.rollout.server``): arguments, model
loading, the bound socket, serving until SIGTERM / SIGINT (:mod:`megaforge.rollout.server`).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from megaforge.config import ModelConfig
from megaforge.net import is_loopback
from megaforge.rollout.http.auth import API_KEY_ENV
from megaforge.rollout.server.limits import (ACCEPT_BACKLOG, ConnectionGuard, default_max_connections, max_token_bytes,
                                             raise_open_file_limit)
from megaforge.rollout.server.state import Server

log = logging.getLogger("megaforge.engine_server")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megaforge.rollout.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None,
                   help="the model id of the OpenAI-compatible routes (/v1/models; default: --model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--attn-implementation", default="sdpa")
    p.add_argument("--max-batch", type=int, default=256, help="sequences decoded at once")
    p.add_argument("--fast", default="auto", choices=["auto", "on", "off"], help="the fast decode path (rollout.fast)")
    p.add_argument("--fast-compile", default="auto", choices=["auto", "inductor", "off"],
                   help="torch.compile of the fast path's layer pieces (rollout.fast_compile)")
    p.add_argument("--fast-attention", default="auto", choices=["auto", "sdpa", "matmul"],
                   help="decode attention of the fast path (rollout.fast_attention)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--sglang-api", default="0.5.23", choices=["0.5.16", "0.5.23"],
                   help="the SGLang release whose weight-update API to speak: 0.5.23 brackets tensor and distributed "
                        "updates by /begin_weight_update .. /end_weight_update and has no /get_weight_version; "
                        "0.5.16 is the other way round (megaforge.rollout.http.versions)")
    p.add_argument("--log-file", default=None)
    p.add_argument("--sock-fd", type=int, default=None, help="serve on this inherited, bound socket")
    p.add_argument("--dist-timeout", type=float, default=600.0, help="seconds for weight-update group set-up")
    p.add_argument("--weight-root", action="append", default=[], metavar="DIR",
                   help="a directory /update_weights_from_disk may read under (repeatable); bound beyond loopback, "
                        "nothing else is readable (none: no disk updates)")
    p.add_argument("--max-bucket-mb", type=int, default=16384,
                   help="largest total size of the tensors of one /update_weights_from_tensor payload (default 16384)")
    p.add_argument("--dist-connect-timeout", type=float, default=30.0,
                   help="seconds /init_weights_update_group may take to reach master_address:master_port (default 30)")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds a connection may stay without a complete request head, after connecting or after "
                        "its last answer (default 30)")
    p.add_argument("--body-timeout", type=float, default=120.0, help="seconds a request body may take (default 120)")
    p.add_argument("--max-connections", type=int, default=0,
                   help="open connections at most (default 0: the open-file limit less a reserve); at the limit the "
                        "oldest idle one is closed")
    p.add_argument("--max-body-readers", type=int, default=0,
                   help="requests that may be sending their bodies at once (default 0: a quarter of the connection "
                        "limit, at least 4); beyond it a request is answered 503 before its body is read, so slow "
                        "bodies cannot take every connection slot")
    p.add_argument("--health-timeout", type=float, default=20.0,
                   help="seconds /health_generate waits for a decoding step (SGLang's HEALTH_CHECK_TIMEOUT, default 20)")
    p.add_argument("--generate-delay", type=float, default=0.0,
                   help="seconds each /generate batch waits after it is accepted (it counts as running) before "
                        "decoding starts: emulates a slow engine for timeout and fault-tolerance tests (default 0)")
    a = p.parse_args(argv)
    a.api_key = a.api_key or os.environ.get(API_KEY_ENV) or None
    return a


def load(args):
    """(engine, tokenizer, eos ids, most bytes of one token) from the command line."""
    import torch

    from megaforge.hf import load_hf_model, load_tokenizer, resolve_device  # lazy: argument errors come first
    from megaforge.rollout.embedded import EmbeddedEngine  # lazy: argument errors come first
    from megaforge.rollout.embedded.engine import fast_options  # lazy: argument errors come first

    tok = None
    try:
        tok = load_tokenizer(ModelConfig(path=args.tokenizer or args.model))
    except (OSError, ValueError) as e:
        if args.tokenizer:
            raise SystemExit(f"megaforge engine server: --tokenizer {args.tokenizer}: {e}")
        log.warning("no tokenizer in %s (%s): text prompts and stop strings are unavailable", args.model, e)
    mc = ModelConfig(path=args.model, dtype=args.dtype, attn_implementation=args.attn_implementation)
    model = load_hf_model(mc, resolve_device(args.device))
    eos = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        eos.update([e] if isinstance(e, int) else (e or []))
    if tok is not None and tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    torch.set_grad_enabled(False)
    token_bytes = max_token_bytes(tok) if tok is not None else 1
    opts = fast_options(args.fast_compile, args.fast_attention, next(model.parameters()).device)
    return EmbeddedEngine(model, tok, max_batch=args.max_batch, fast=args.fast, fast_options=opts), tok, sorted(eos), token_bytes


def bind(args) -> socket.socket:
    if args.sock_fd is not None:
        sock = socket.socket(fileno=args.sock_fd)
    else:
        fam = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve(args, sock: socket.socket) -> None:
    from aiohttp import web

    from megaforge.rollout.server.routes import build_app  # lazy: argument errors come first

    engine, tok, eos, token_bytes = await asyncio.get_running_loop().run_in_executor(None, load, args)
    host, port = sock.getsockname()[:2]
    srv = Server(args, engine, tok, eos, host, port, token_bytes)
    runner = web.AppRunner(build_app(srv, args.api_key), access_log=None, handle_signals=False,
                           keepalive_timeout=args.idle_timeout)
    await runner.setup()
    srv.guard = ConnectionGuard(runner.server, default_max_connections(args.max_connections))
    if args.max_body_readers <= 0:
        args.max_body_readers = max(4, srv.guard.max_connections // 4)
    listener = await asyncio.get_running_loop().create_server(srv.guard, sock=sock, backlog=ACCEPT_BACKLOG)
    log.info("serving %s on http://%s:%d (weight version %s, auth %s, context %d tokens, at most %d connections, "
             "%d reading bodies)", args.model, host, port, srv.version, "on" if args.api_key else "off", srv.context,
             srv.guard.max_connections, args.max_body_readers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()
    log.info("shutting down")
    srv.abort_all()
    listener.close()
    await runner.cleanup()
    srv.pool.shutdown(wait=False, cancel_futures=True)
    srv.dist_pool.shutdown(wait=False, cancel_futures=True)
    srv.decode_pool.shutdown(wait=False, cancel_futures=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    handlers = [logging.FileHandler(args.log_file)] if args.log_file else [logging.StreamHandler(sys.stderr)]
    logging.basicConfig(level=logging.INFO, handlers=handlers, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"megaforge engine server: --model {args.model}: no config.json there", file=sys.stderr)
        raise SystemExit(2)
    old_nofile, nofile = raise_open_file_limit()
    if nofile != old_nofile:
        log.info("open-file limit raised from %d to %d", old_nofile, nofile)
    sock = bind(args)
    host = sock.getsockname()[0]
    if not is_loopback(host) and not args.api_key:
        print(f"megaforge engine server: refusing to serve on {host} (not loopback) without an API key: pass "
              f"--api-key or set ${API_KEY_ENV} (admin endpoints would be open to the network)", file=sys.stderr)
        raise SystemExit(2)
    if args.api_key and len(args.api_key) < 8:
        print("megaforge engine server: --api-key must have at least 8 characters", file=sys.stderr)
        raise SystemExit(2)
    asyncio.run(serve(args, sock))
    logging.shutdown()
    os._exit(0)  # do not wait on a worker thread blocked in a rendezvous
