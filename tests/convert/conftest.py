"""Fixtures of the conversion tests (helpers in cv_helpers.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cv_helpers import MODELS, make_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """{name: HF directory} of every model in cv_helpers.MODELS, plus ``qwen3_moe_other`` (same
    config as qwen3_moe, other weights: a trainer built from it must take the checkpoint's)."""
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("cv_hf")
    out = {name: make_model(str(root / name), **kw) for name, kw in MODELS.items()}
    out["qwen3_moe_other"] = make_model(str(root / "qwen3_moe_other"), **dict(MODELS["qwen3_moe"], seed=99))
    return out
