"""Rollout engines behind :class:`megaforge.rollout.base.Engine`."""
from __future__ import annotations

ENGINES = ("embedded", "embedded_server", "sglang")


def preflight(cfg) -> None:
    """Checks that need no engine yet (run at start-up, before any SFT): e.g. sglang installed."""
    if cfg.rollout.engine == "sglang":
        from megaforge.rollout.http_launch import require_sglang

        require_sglang(router=cfg.rollout.router and cfg.rollout.num_engines > 1)


def build_engine(cfg, tokenizer):
    """The configured engine (``rollout.engine``), built on the rank that feeds engines."""
    kind = cfg.rollout.engine
    if kind == "embedded":
        from megaforge.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine.from_config(cfg, tokenizer)
    if kind in ("embedded_server", "sglang"):
        from megaforge.rollout.http_launch import build_http_engine

        return build_http_engine(cfg, tokenizer, kind)
    raise ValueError(f"rollout.engine {kind!r} is not available in this build; valid: {', '.join(ENGINES)}")
