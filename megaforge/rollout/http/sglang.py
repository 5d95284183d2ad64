"""``rollout.engine: sglang``: SGLang servers (``python -m sglang.launch_server`` in the engine
interpreter, ``rollout.engine_python`` / ``rollout.engine_env``) on CUDA GPUs, started by
:func:`megaforge.rollout.http.start.build_http_engine` (registered in megaforge.engine_kinds)."""
from __future__ import annotations

import torch

from megaforge.rollout.http.lora import check_targets, lora_flags
from megaforge.rollout.http.start import Servers, ServerStart, build_http_engine, engine_env, engine_python, require_sglang
from megaforge.specs import EngineSpec, expect


def preflight(spec: EngineSpec) -> None:
    """sglang (and sglang-router with ``rollout.router`` over several engines) installed in the engine
    interpreter, in a release megaforge supports."""
    expect(spec, EngineSpec, "sglang preflight")
    require_sglang(spec, router=spec.rollout.router and spec.rollout.num_engines > 1)
    check_targets(spec)  # sync.lora_adapters: model.lora's targets among SGLang's


def command(spec, s: ServerStart, port: int, fd: int) -> list[str]:
    """One server's command line (``fd`` unused: SGLang binds ``port`` itself)."""
    r = spec.rollout
    c = [engine_python(spec), "-m", "sglang.launch_server", "--model-path", s.model_dir, "--host", r.host,
         "--port", str(port), "--tp-size", str(r.tensor_parallel), "--mem-fraction-static", str(r.mem_fraction),
         "--dtype", spec.dtype, "--weight-version", "0", "--random-seed", str(spec.seed)]
    c += ["--tokenizer-path", s.tok_dir] if s.tok_dir else []
    c += ["--enable-memory-saver"] if r.num_gpus == 0 else []
    c += ["--api-key", s.api_key] if s.api_key else []
    c += ["--enable-return-routed-experts"] if r.return_routed_experts else []  # routing replay
    c += lora_flags(spec.model.lora, r.num_gpus == 0) if spec.lora_adapters else []  # megaforge.rollout.http.lora
    return c + list(r.extra_args)


def env(spec, s: ServerStart) -> dict:
    """The engine interpreter's environment: this process's with ``rollout.engine_env`` on top."""
    return engine_env(spec)


# the step's health check: /server_info is a round trip to the scheduler (get_internal_state); SGLang's
# /health_generate spends at least 1 s (asyncio.sleep(1) before its first look): 1 s of every RL step
SERVERS = Servers(command, env, health_probe="/server_info")


def build(spec: EngineSpec, tokenizer, node=None):
    """The HTTPEngine over ``rollout.num_engines`` SGLang servers on CUDA GPUs (checked by :func:`preflight`
    first)."""
    preflight(spec)
    return build_http_engine(spec, tokenizer, SERVERS, torch.device("cuda"), node=node)
