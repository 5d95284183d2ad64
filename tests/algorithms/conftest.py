import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from algo_helpers import ROOT  # noqa: E402


@pytest.fixture
def in_root(monkeypatch):
    """Relative paths of the configs (configs/models/..., assets/...) resolve from the repo root."""
    monkeypatch.chdir(ROOT)
    return ROOT
