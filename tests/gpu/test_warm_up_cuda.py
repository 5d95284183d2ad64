"""Trainer.warm_up on CUDA (megaforge.trainer.warm_up: the loop runs it beside the engines' start):
a cold Megatron trainer's first RL step makes torch.compile graphs (megatron-core's fused functions,
megaforge's compiled log-probs; compiled once for the shapes first met, once more as dynamic graphs);
after the warm-up, the first RL step, on other shapes than the warm-up's, makes none. A 4-layer
Qwen2 in bfloat16, torch spec, one process. Skipped without CUDA (conftest). What it leaves behind
(nothing): tests/algorithms/test_warm_up.py, tests/megatron/test_warm_up_megatron.py."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
from mt_helpers import make_tiny, run_workers  # noqa: E402


def test_first_step_compiles_nothing_after_the_warm_up(tmp_path):
    (r,) = run_workers("warm_up_cuda", 1, {"model": make_tiny("qwen2", str(tmp_path / "qwen2"))}, tmp_path, timeout=400)
    print(json.dumps({k: r[k] for k in ("cold_step_graphs", "warm_up_graphs", "warm_step_graphs", "warm_up_s")}))
    assert r["cold_step_graphs"] > 0, "a cold first step compiled nothing: this test would show nothing"
    assert r["warm_up_graphs"] > 0
    assert r["warm_step_graphs"] == 0, f"the first step after the warm-up compiled {r['warm_step_graphs']} graphs"
