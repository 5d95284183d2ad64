"""metrics.jsonl across attempts: a resume cuts the file back to the checkpoint's step and a restart
without a checkpoint starts it again, but the rows removed are kept in metrics.superseded.jsonl."""
import json
import os

from megaforge.config import load_config
from megaforge.metrics import MetricsLogger, superseded_path, truncate_jsonl


def _cfg():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_config(["--config", os.path.join(root, "configs", "demo_cpu.yaml"), "--metrics.tensorboard", "false",
                        "--metrics.wandb", "false"]).metrics


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _write(path, steps):
    with open(path, "w") as f:
        f.write("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps))


def test_resume_keeps_rows_after_the_checkpoint_aside(tmp_path, capsys):
    path = str(tmp_path / "metrics.jsonl")
    _write(path, [1, 2, 3, 4, 5])
    logger = MetricsLogger(_cfg(), str(tmp_path), resume_step=3)
    logger.log(4, {"loss": 0.9})
    logger.close()
    assert [r["step"] for r in _rows(path)] == [1, 2, 3, 4]
    assert _rows(path)[-1]["loss"] == 0.9
    aside = _rows(superseded_path(path))
    assert [(r["step"], r["loss"]) for r in aside] == [(4, 0.4), (5, 0.5)]
    assert all(isinstance(r["superseded_at"], float) for r in aside)
    assert "2 rows (steps after 3, the checkpoint resumed from) moved to" in capsys.readouterr().out


def test_restart_without_checkpoint_keeps_every_row_aside(tmp_path, capsys):
    path = str(tmp_path / "metrics.jsonl")
    _write(path, [1, 2])
    MetricsLogger(_cfg(), str(tmp_path)).close()  # --resume that found no checkpoint
    assert _rows(path) == []
    assert [r["step"] for r in _rows(superseded_path(path))] == [1, 2]
    assert "2 rows (an earlier attempt that left no checkpoint)" in capsys.readouterr().out
    _write(path, [1])  # a second such attempt appends, it does not overwrite
    MetricsLogger(_cfg(), str(tmp_path)).close()
    assert [r["step"] for r in _rows(superseded_path(path))] == [1, 2, 1]


def test_nothing_dropped_writes_no_file(tmp_path, capsys):
    path = str(tmp_path / "sft_metrics.jsonl")
    _write(path, [1, 2])
    assert truncate_jsonl(path, 2) == 0
    assert not os.path.exists(superseded_path(path))
    assert superseded_path(path).endswith("sft_metrics.superseded.jsonl")
    MetricsLogger(_cfg(), str(tmp_path), filename="sft_metrics.jsonl", resume_step=2).close()
    assert capsys.readouterr().out == ""
