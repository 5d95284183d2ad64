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


def test_overlay_puts_runs_on_one_axes_and_names_a_run_without_the_key(tmp_path):
    key = "eval/g/greedy/pass@1"
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in [{"step": 10, key: 0.3, "loss": 1.0}, {"step": 0, key: 0.2}]))
    b.write_text(json.dumps({"step": 0, key: 0.25}) + "\n" + json.dumps({"step": 5, "loss": 2.0}) + "\n")
    c.write_text(json.dumps({"step": 0, "eval/g/greedy/reward/mean": 0.1}) + "\n")
    runs = plot_run.parse_overlay([f"distill={a}", f"grpo={b}"])
    assert plot_run.overlay_series(runs, key) == {"distill": [(0, 0.2), (10, 0.3)], "grpo": [(0, 0.25)]}
    plot_run.main(["--overlay", f"distill={a}", "--overlay", f"grpo={b}", "--keys", key, "--out", str(tmp_path / "o.png")])
    with open(tmp_path / "o.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    try:
        plot_run.overlay_series(plot_run.parse_overlay([f"lora={c}"]), key)
        raise AssertionError("a run without the key was drawn")
    except SystemExit as e:
        assert str(c) in str(e) and "lora" in str(e) and "eval/g/greedy/reward/mean" in str(e)
    for bad in ("nolabel", f"x={tmp_path / 'missing.jsonl'}"):
        try:
            plot_run.parse_overlay([bad])
            raise AssertionError(f"{bad!r} was accepted")
        except SystemExit as e:
            assert bad.split("=")[0] in str(e)
