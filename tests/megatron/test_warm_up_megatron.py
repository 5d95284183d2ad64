"""Trainer.warm_up on the Megatron backend, two data-parallel ranks (gloo, CPU; the distributed
optimizer): it leaves the weights, the gradient buffers (zero), the optimizer state (none), the
weight version and the random stream as they were, and the RL step after it equals a fresh trainer's
first. Exact: the same ops in the same order in one process per rank (not a cross-machine rounding
claim). The torch backend's: tests/algorithms/test_warm_up.py; on CUDA: tests/gpu/test_warm_up_cuda.py."""
import torch
from mt_helpers import run_workers


def test_megatron_warm_up_leaves_no_trace(tiny_models, tmp_path):
    for r in run_workers("warm_up", 2, {"model": tiny_models["qwen2"], "layout": {}}, tmp_path, timeout=300):
        assert r["rng_kept"] and r["version"] == 0 and r["opt_state"] == 0 and r["grad_abs_sum"] == 0.0
        for k, v in r["weights0"].items():
            assert torch.equal(r["weights_warm"][k], v), f"{k}: the warm-up moved it"
        assert r["metrics"] == r["fresh_metrics"]
        for k, v in r["fresh_weights"].items():
            assert torch.equal(r["weights"][k], v), f"{k}: the step after the warm-up differs from a fresh trainer's"
