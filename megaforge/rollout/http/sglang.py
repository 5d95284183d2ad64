"""``rollout.engine: sglang``: SGLang servers (``python -m sglang.launch_server`` in the engine
interpreter, ``rollout.engine_python`` / ``rollout.engine_env``) on CUDA GPUs, started by
:func:`megaforge.rollout.http.start.build_http_engine` (registered in megaforge.engine_kinds)."""
from __future__ import annotations

from megaforge.rollout.http.lora import check_targets, lora_flags
from megaforge.rollout.http.start import Servers, ServerStart, build_http_engine, engine_env, engine_python, require_sglang


def preflight(cfg) -> None:
    """sglang (and sglang-router with ``rollout.router`` over several engines) installed in the engine
    interpreter, in a release megaforge supports."""
    require_sglang(cfg, router=cfg.rollout.router and cfg.rollout.num_engines > 1)
    check_targets(cfg)  # sync.lora_adapters: model.lora's targets among SGLang's


def command(cfg, s: ServerStart, port: int, fd: int) -> list[str]:
    """One server's command line (``fd`` unused: SGLang binds ``port`` itself)."""
    r = cfg.rollout
    c = [engine_python(cfg), "-m", "sglang.launch_server", "--model-path", s.model_dir, "--host", r.host,
         "--port", str(port), "--tp-size", str(r.tensor_parallel), "--mem-fraction-static", str(r.mem_fraction),
         "--dtype", cfg.engine_dtype, "--weight-version", "0", "--random-seed", str(cfg.seed)]
    c += ["--tokenizer-path", s.tok_dir] if s.tok_dir else []
    c += ["--enable-memory-saver"] if r.num_gpus == 0 else []
    c += ["--api-key", s.api_key] if s.api_key else []
    c += ["--enable-return-routed-experts"] if r.return_routed_experts else []  # routing replay
    c += lora_flags(cfg.model.lora, r.num_gpus == 0) if cfg.sync.lora_adapters else []  # megaforge.rollout.http.lora
    return c + list(r.extra_args)


def env(cfg, s: ServerStart, gpus) -> dict:
    return engine_env(cfg, gpus)


SERVERS = Servers(command, env)


def build(cfg, tokenizer, node=None):
    """The HTTPEngine over ``rollout.num_engines`` SGLang servers (checked by :func:`preflight` first)."""
    preflight(cfg)
    return build_http_engine(cfg, tokenizer, SERVERS, node=node)
