"""tools/check_parity.py and tools/bench_train.py run and report (CPU, gloo)."""
import json
import os

from mt_helpers import ROOT, run_ranks, tails

PARITY = os.path.join(ROOT, "tools", "check_parity.py")


def _json_line(log: str) -> dict:
    lines = [ln for ln in log.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, log[-3000:]
    return json.loads(lines[0])


def test_check_parity_tp2_sp_passes_and_fails_above_tol(tiny_models, tmp_path):
    codes, logs = run_ranks([PARITY, "--hf", tiny_models["qwen2"], "--tp", "2", "--sp", "--seq", "32"], 2,
                            tmp_path, "parity")
    assert codes == [0, 0], tails(logs)
    rep = _json_line(logs[0])
    assert rep["ok"] and rep["max_abs_logprob_diff"] <= 1e-5 and rep["argmax_agreement"] == 1.0, rep
    # rows of lengths 8, 16, 24, 32: 7 + 15 + 23 + 31 predicted tokens
    assert (rep["tp"], rep["sp"], rep["family"], rep["tokens"]) == (2, True, "qwen2", 76), rep
    assert not any(ln.startswith("{") for ln in logs[1].splitlines()), "only rank 0 reports"
    codes, logs = run_ranks([PARITY, "--hf", tiny_models["llama_tied"], "--tol", "0", "--seq", "16"], 1,
                            tmp_path, "parity_fail")
    assert codes == [1], tails(logs)
    rep = _json_line(logs[0])
    assert rep["ok"] is False and rep["max_abs_logprob_diff"] > 0.0


def test_bench_train_tiny_runs_both_steps(tmp_path):
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench_train.py"), "--tiny"], 1, tmp_path, "bench")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert rep["ours_tflops_per_gpu"] > 0 and rep["raw_tflops_per_gpu"] > 0 and rep["tokens_per_step"] == 4 * 64
