"""``rollout.engine: embedded_server``: megaforge's embedded engine behind SGLang's HTTP API
(``python -m megaforge.rollout.server``, one process per engine, TP 1) on ``rollout.device``, started
by :func:`megaforge.rollout.http.start.build_http_engine` (registered in megaforge.engine_kinds)."""
from __future__ import annotations

import sys

from megaforge.hf import resolve_device
from megaforge.rollout.http.auth import API_KEY_ENV
from megaforge.supervise import child_env
from megaforge.rollout.http.start import Servers, ServerStart, build_http_engine, require_sglang
from megaforge.specs import EngineSpec, expect


def command(spec, s: ServerStart, port: int, fd: int) -> list[str]:
    """One server's command line: it serves on the listening socket ``fd`` this process holds."""
    r = spec.rollout
    c = [sys.executable, "-m", "megaforge.rollout.server", "--model", s.model_dir, "--host", r.host,
         "--port", str(port), "--sock-fd", str(fd), "--device", "cuda" if s.device.type == "cuda" else "cpu",
         "--dtype", spec.dtype, "--attn-implementation", spec.model.attn_implementation,
         "--max-batch", str(r.engine_batch_size), "--weight-version", "0", "--fast", r.fast,
         "--fast-compile", r.fast_compile, "--fast-attention", r.fast_attention]
    c += [a for root in s.roots for a in ("--weight-root", root)]
    return c + (["--tokenizer", s.tok_dir] if s.tok_dir else []) + list(r.extra_args)


def env(spec, s: ServerStart) -> dict:
    """This process's environment (this interpreter runs the server), the API key in it."""
    return child_env(extra={API_KEY_ENV: s.api_key} if s.api_key else None)


SERVERS = Servers(command, env, hold_socket=True)


def build(spec: EngineSpec, tokenizer, node=None):
    """The HTTPEngine over ``rollout.num_engines`` embedded servers (TP 1; SGLang's router in front
    with ``rollout.router``, which needs sglang-router), on ``rollout.device``."""
    r = expect(spec, EngineSpec, "embedded_server build").rollout
    if r.tensor_parallel != 1:
        raise ValueError("rollout.tensor_parallel: the embedded server runs TP 1 (use rollout.num_engines)")
    if r.router and r.num_engines > 1:
        require_sglang(spec, router=True)
    return build_http_engine(spec, tokenizer, SERVERS, resolve_device(r.device), node=node)
