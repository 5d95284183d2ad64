"""tools/plot_run.py draws the SFT phase (sft_metrics.jsonl: a warm start or an SFT run) before the RL
curves (issue 41, point 8), and plots an SFT-only run, which has no metrics.jsonl."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot_run  # noqa: E402


def write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_sft_records_are_loaded_as_sft_curves_and_drawn(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write(run / "sft_metrics.jsonl", [{"step": s, "loss": 5.0 / s, "grad_norm": 1.0, "lr": 3e-3} for s in (1, 2, 3)])
    write(run / "metrics.jsonl", [{"step": s, "reward/mean": 0.1 * s, "loss": 0.01} for s in (1, 2)])
    recs = plot_run.load(str(run))
    assert [r["sft/loss"] for r in recs if "sft/loss" in r] == [5.0, 2.5, 5.0 / 3]
    assert [r["step"] for r in recs if "reward/mean" in r] == [1, 2]
    assert not any("loss" in r and "sft/loss" in r for r in recs)  # the phases' losses stay apart
    plot_run.main([str(run)])
    assert capsys.readouterr().out.strip() == str(run / "curves.png")
    with open(run / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_an_sft_only_run_is_plotted(tmp_path):
    write(tmp_path / "sft_metrics.jsonl", [{"step": s, "loss": 1.0 / s} for s in (1, 2)])
    plot_run.main([str(tmp_path), "--out", str(tmp_path / "s.png")])
    assert os.path.getsize(tmp_path / "s.png") > 0
