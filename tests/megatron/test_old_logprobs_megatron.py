"""Trainer.set_old_logprobs on the Megatron backend, two data-parallel ranks (gloo, CPU): pi_old's
no-grad forward leaves out the first mini-batch's rows (its update's own forward, detached, is pi_old),
and the RL step then equals the step given pi_old of every row.

Tolerance: the first mini-batch's pi_old is its own forward's log-probs in one run and a separate
no-grad forward's in the other, equal in exact arithmetic; float32 rounding of the two forwards is
the only difference allowed (rtol 1e-5, atol 1e-6 on weights moved ~1e-3 by the step). The torch
backend's: tests/algorithms/test_old_logprobs.py."""
import torch
from mt_helpers import run_workers


def test_pi_old_skips_the_first_mini_batch_and_the_step_is_the_same(tiny_models, tmp_path):
    for r in run_workers("old_first_update", 2, {"model": tiny_models["qwen2"], "layout": {}}, tmp_path, timeout=300):
        skip, full = r["skip"], r["every_row"]
        first = skip["first_rows"]
        assert skip["flag"] and not full["flag"]
        assert skip["seen"] == [skip["rows"] - first] and full["seen"] == [full["rows"]]  # rows of the no-grad forward
        assert first > 0 and torch.count_nonzero(skip["old"][:first]) == 0
        torch.testing.assert_close(skip["old"][first:], full["old"][first:], rtol=1e-5, atol=1e-6)
        for k in ("loss", "pg_loss", "grad_norm", "entropy"):
            assert abs(skip["metrics"][k] - full["metrics"][k]) <= 1e-5 * (1 + abs(full["metrics"][k])), k
        for k, v in full["weights"].items():
            torch.testing.assert_close(skip["weights"][k], v, rtol=1e-5, atol=1e-6, msg=k)
