"""GPU integration tests against a real SGLang server (one command on a CUDA machine):

    MEGAFORGE_SGLANG_ENV_SH=/tmp/sgl/env.sh python -m pytest -q tests/gpu

``MEGAFORGE_SGLANG_ENV_SH``: a shell file that sets up the server's environment (the GPU machine's
SGLang kit writes ``/tmp/sgl/env.sh``: its PYTHONPATH, LD_LIBRARY_PATH, PATH, CUDA_HOME); what it
changes becomes ``rollout.engine_env``, so the server runs with its own packages (transformers 5.12.1
there) and the tests with this interpreter's. ``MEGAFORGE_SGLANG_PYTHON``: another interpreter (a
virtualenv's) instead or as well. Skipped without CUDA or without an sglang there.
"""
from __future__ import annotations

import os
import subprocess

import pytest
import torch


def sglang_env() -> dict:
    """The environment variables ``MEGAFORGE_SGLANG_ENV_SH`` sets or changes ({} when unset)."""
    path = os.environ.get("MEGAFORGE_SGLANG_ENV_SH", "")
    if not path:
        return {}
    out = subprocess.run(["bash", "-c", 'set -a; . "$1" >/dev/null; env -0', "_", path], capture_output=True,
                         check=True)
    env = dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if "=" in kv)
    return {k: v for k, v in env.items() if os.environ.get(k) != v and k not in ("_", "SHLVL", "PWD", "OLDPWD")}


def sglang_python() -> str:
    return os.environ.get("MEGAFORGE_SGLANG_PYTHON", "")


def sglang_version() -> str | None:
    from megaforge.config import config_from_dict
    from megaforge.configtree import ConfigError
    from megaforge.rollout.http_launch import require_sglang

    cfg = config_from_dict({"rollout": {"engine": "sglang", "engine_env": sglang_env(),
                                        "engine_python": sglang_python()}})
    try:
        return require_sglang(cfg)
    except ConfigError:
        return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    gpu = [i for i in items if str(i.fspath).startswith(here)]
    if not gpu:
        return
    why = None
    if not torch.cuda.is_available():
        why = "needs a CUDA GPU"
    elif sglang_version() is None:
        why = "needs sglang (set MEGAFORGE_SGLANG_ENV_SH / MEGAFORGE_SGLANG_PYTHON to an environment that has it)"
    if why:
        for i in gpu:
            i.add_marker(pytest.mark.skip(reason=why))
