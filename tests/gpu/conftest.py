"""GPU integration tests against a real SGLang server (one command on a CUDA machine):

    MEGAFORGE_SGLANG_ENV_SH=/tmp/sgl/env.sh python -m pytest -q tests/gpu

``MEGAFORGE_SGLANG_ENV_SH``: a shell file that sets up the server's environment (the GPU machine's
SGLang kit writes ``/tmp/sgl/env.sh``: its PYTHONPATH, LD_LIBRARY_PATH, PATH, CUDA_HOME); what it
changes becomes ``rollout.engine_env``, so the server runs with its own packages (transformers 5.12.1
there) and the tests with this interpreter's. ``MEGAFORGE_SGLANG_PYTHON``: another interpreter (a
virtualenv's) instead or as well. Skipped without CUDA; the server tests also without an sglang there
(test_fast_engine_cuda.py needs CUDA only).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_helpers import sglang_version  # noqa: E402


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    gpu = [i for i in items if str(i.fspath).startswith(here)]
    if not gpu:
        return
    if not torch.cuda.is_available():
        for i in gpu:
            i.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        return
    server = [i for i in gpu if "sglang" in os.path.basename(str(i.fspath))]  # the rest needs CUDA only
    if server and sglang_version() is None:
        why = "needs sglang (set MEGAFORGE_SGLANG_ENV_SH / MEGAFORGE_SGLANG_PYTHON to an environment that has it)"
        for i in server:
            i.add_marker(pytest.mark.skip(reason=why))
