"""Rollout engines behind :class:`megaforge.rollout.base.Engine`."""
from __future__ import annotations


def build_engine(cfg, tokenizer):
    """The configured engine (``rollout.engine``), built on the rank that feeds engines."""
    kind = cfg.rollout.engine
    if kind == "embedded":
        from megaforge.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine.from_config(cfg, tokenizer)
    raise ValueError(f"rollout.engine {kind!r} is not available in this build; valid: embedded")
