"""Helpers of the GPU tests: the SGLang environment they run the server in (see conftest.py)."""
from __future__ import annotations

import os

from megaforge.build import RunBuilder


def sglang_env() -> dict:
    """The environment variables ``MEGAFORGE_SGLANG_ENV_SH`` sets or changes ({} when unset)."""
    from megaforge.supervise import env_from_script

    path = os.environ.get("MEGAFORGE_SGLANG_ENV_SH", "")
    return env_from_script(path) if path else {}


def sglang_python() -> str:
    return os.environ.get("MEGAFORGE_SGLANG_PYTHON", "")


def sglang_version() -> str | None:
    from megaforge.config import config_from_dict
    from megaforge.configtree import ConfigError
    from megaforge.rollout.http.start import require_sglang

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = config_from_dict({"model": {"config": os.path.join(root, "configs", "models", "tiny-qwen2")}, "max_steps": 0,
                            "rollout": {"engine": "sglang", "engine_env": sglang_env(),
                                        "engine_python": sglang_python()}})
    try:
        return require_sglang(RunBuilder(cfg).engine_spec())
    except ConfigError:
        return None
