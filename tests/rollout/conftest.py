"""Fixtures of the HTTP engine tests (servers run on 127.0.0.1 with fresh ports)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engine_helpers import save_tiny_qwen2  # noqa: E402


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> str:
    """Tiny Qwen2 (2 layers, hidden 64, vocab 512) with room for long generations."""
    return save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny-qwen2-long")))
