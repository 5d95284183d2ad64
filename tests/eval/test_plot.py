"""tools/plot_run.py draws the held-out evaluation's curves (per set: greedy pass@1, sampled pass@k by k,
greedy reward and response length) after the training curves, or alone with --eval_only."""
import json
import os
import sys

from eval_helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot_run  # noqa: E402


def test_eval_curves_are_found_and_drawn(tmp_path):
    recs = [{"step": 0, "eval/g/greedy/pass@1": 0.2, "eval/g/sampled/pass@8": 0.5, "eval/g/sampled/pass@1": 0.1,
             "eval/g/sampled/pass@16": 0.6, "eval/g/greedy/reward/mean": 0.2, "eval/g/greedy/response_len/mean": 90.0,
             "eval/g/prompts": 10.0, "eval/a/greedy/pass@1": 0.4}]
    recs += [{"step": s, "reward/mean": 0.1 * s, "loss": 1.0} for s in (1, 2)]
    recs += [{"step": 3, "reward/mean": 0.2, "eval/g/greedy/pass@1": 0.4, "eval/a/greedy/pass@1": 0.5}]
    assert plot_run.eval_keys(recs) == [
        "eval/a/greedy/pass@1", "eval/g/greedy/pass@1", "eval/g/sampled/pass@1", "eval/g/sampled/pass@8",
        "eval/g/sampled/pass@16", "eval/g/greedy/reward/mean", "eval/g/greedy/response_len/mean"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    plot_run.main([str(run), "--eval_only", "--out", str(tmp_path / "e.png")])
    with open(tmp_path / "e.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
