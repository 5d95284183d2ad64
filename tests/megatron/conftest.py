"""Fixtures of the Megatron backend tests (helpers in mt_helpers.py)."""
import os
import sys

import pytest

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mt_helpers import MODELS, make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{name: HF directory} for Llama (tied embeddings), Qwen2 (qkv bias), Qwen3 (q/k norm)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: make_tiny(kind, str(root / name), tied) for name, (kind, tied) in MODELS.items()}
