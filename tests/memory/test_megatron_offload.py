"""Megatron backend offload through the copy engine (CPU-emulated) on 2 data-parallel ranks with the
distributed optimizer (sharded fp32 main parameters and Adam state), float32 and bfloat16: DDP param
buffers (fixed, kept), grad buffers (fixed, zero after onload), main parameters and optimizer state
(movable), the reference model, the PPO critic's buffers and optimizer; a trainer that offloads
between steps ends bit-identical to one that never does (policy weights, metrics, critic values)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))

pytestmark = pytest.mark.timeout(600)


def test_megatron_offload_two_ranks(tmp_path):
    from mt_helpers import make_tiny, run_ranks, tails

    model = make_tiny("qwen2", str(tmp_path / "qwen2"))
    codes, logs = run_ranks([os.path.join(HERE, "mt_offload_worker.py"), model, str(tmp_path)], 2, tmp_path,
                            "offload", timeout=540)
    assert not any(codes), tails(logs)
    for r in range(2):
        res = torch.load(str(tmp_path / f"offload.rank{r}.pt"), weights_only=False)
        for dtype in ("float32", "bfloat16"):
            a, b = res[(dtype, True)], res[(dtype, False)]
            ck = a["checks"]
            # (state, kept, fixed): gradient buffers; critic weight buffers; optimizer / reference tensors
            assert ck["kinds"] == [("state", False, False), ("state", True, False), ("state", True, True),
                                   ("weights", True, False)], ck["kinds"]
            if dtype == "bfloat16":
                assert ck["main_params"] > 0, "fp32 main parameters of bf16 weights are offloaded"
            for key in ("state_freed", "weights_kept", "all_freed", "ids", "values"):
                assert ck[key] == [True] * 3, (dtype, r, key, ck[key])
            if r == 0:  # (iter_hf_buckets hands tensors to rank 0 only)
                assert min(ck["hf_while_state_out"]) > 0, "HF weights readable while the state is out"
            assert len(set(a["host_allocs"])) == 1, f"host buffers re-allocated: {a['host_allocs']}"
            assert a["metrics"] == b["metrics"], dtype
            assert all(m["critic/grad_norm"] > 0 for m in a["metrics"]), "the critic trained in every step"
            assert torch.equal(a["critic_values"], b["critic_values"]), dtype
            assert a["weights"].keys() == b["weights"].keys()
            for n in b["weights"]:
                assert torch.equal(a["weights"][n], b["weights"][n]), (dtype, n)
