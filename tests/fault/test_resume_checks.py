"""What --resume checks before it loads anything (megaforge.resume, megaforge.metrics.set_aside_bad_rows):
the run folder's config.yaml against the new configuration (every change printed; changes that alter
the run's steps refused unless resume_allow_changes names them), and metrics rows that are not rows
(not UTF-8, malformed) moved aside byte for byte. The runs are tiny CPU-demo runs in this process."""
import os

import pytest
import yaml
from run_helpers import lines, run_in_process

from megaforge.metrics import bad_rows_path, set_aside_bad_rows
from megaforge.resume import config_changes, harmless

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--sft.max_steps", "0", "--rollout.batch_size", "2",
        "--grpo.n_samples", "2", "--rollout.max_new_tokens", "6", "--metrics.progress", "false",
        "--metrics.tensorboard", "false", "--metrics.log_samples", "0", "--deterministic", "true",
        "--rollout.device", "cpu"]


def go(out, *extra):
    return run_in_process("grpo", [*ARGS, "--output_dir", str(out), "--run_name", "r", *extra])


@pytest.fixture
def run2(tmp_path):
    """A finished 2-step run (checkpoint step_000002); its folder."""
    rc, _, err = go(tmp_path, "--max_steps", "2")
    assert rc == 0, err[-2000:]
    return tmp_path / "r"


def test_resume_names_every_change_and_refuses_those_that_change_the_steps(tmp_path, run2):
    saved = (run2 / "config.yaml").read_text()
    rc, out, err = go(tmp_path, "--max_steps", "3", "--resume", "--seed", "1", "--grpo.n_samples", "4",
                      "--trainer.lr", "1e-3")
    assert rc == 1
    assert "[megaforge] --resume: config change max_steps: 2 -> 3 (does not change the steps)" in out
    assert "[megaforge] --resume: config change seed: 0 -> 1 (REFUSED: changes the run's steps)" in out
    assert "config change grpo.n_samples: 2 -> 4 (REFUSED" in out and "config change trainer.lr: 0.0003 -> 0.001 (REFUSED" in out
    assert err.strip().count("\n") == 0 and err.startswith("megaforge: error: --resume: seed, grpo.n_samples, "
                                                           "trainer.lr changed since the run's ")
    assert "--resume_allow_changes seed,grpo.n_samples,trainer.lr" in err
    # nothing was changed: the config, the rows, the checkpoints
    assert (run2 / "config.yaml").read_text() == saved
    assert [r["step"] for r in lines(run2 / "metrics.jsonl")] == [1, 2]
    assert sorted(os.listdir(run2 / "checkpoints")) == ["step_000002"]

    # allowed by name (a section allows every key under it): the run goes on; the old config is kept
    rc, out, err = go(tmp_path, "--max_steps", "3", "--resume", "--seed", "1", "--grpo.n_samples", "4",
                      "--trainer.lr", "1e-3", "--resume_allow_changes", "seed, grpo.n_samples,trainer")
    assert rc == 0, err[-2000:]
    assert "config change trainer.lr: 0.0003 -> 0.001 (allowed by resume_allow_changes)" in out
    assert "resumed from" in out and [r["step"] for r in lines(run2 / "metrics.jsonl")] == [1, 2, 3]
    # the new lr is the one step 3 trains with (the checkpoint's schedule takes it)
    assert "the checkpoint's learning-rate schedule takes the config's peak 0.0003 -> 0.001" in out
    assert [r["lr"] for r in lines(run2 / "metrics.jsonl")] == [3e-4, 3e-4, 1e-3]
    assert (run2 / "logs" / "config.1.yaml").read_text() == saved
    new = yaml.safe_load((run2 / "config.yaml").read_text())
    assert (new["seed"], new["grpo"]["n_samples"], new["trainer"]["lr"]) == (1, 4, 1e-3)

    # harmless changes alone: printed, not refused; an unchanged resume prints none
    rc, out, err = go(tmp_path, "--max_steps", "4", "--resume", "--seed", "1", "--grpo.n_samples", "4",
                      "--trainer.lr", "1e-3", "--checkpoint.keep_last_n", "3", "--eval.interval", "2")
    assert rc == 0, err[-2000:]
    assert "config change max_steps: 3 -> 4 (does not change the steps)" in out
    assert "config change checkpoint.keep_last_n: 2 -> 3 (does not change the steps)" in out
    assert "config change seed" not in out and "config change resume" not in out


def test_which_changes_are_harmless():
    assert [harmless(k) for k in ("max_steps", "metrics.wandb", "eval.interval", "checkpoint.interval",
                                  "rollout.request_timeout_s")] == [True] * 5
    assert [harmless(k) for k in ("seed", "grpo.n_samples", "trainer.lr", "data.path", "model.path", "eval.sets",
                                  "rollout.max_new_tokens", "max_steps_x")] == [False] * 8
    old = {"seed": 0, "resume": False, "data": {"path": "a", "synthetic_kwargs": {"n": 1}}, "gone": 1}
    new = {"seed": 0, "resume": True, "data": {"path": "a", "synthetic_kwargs": {"n": 2}}, "added": [1]}
    assert config_changes(old, new) == [("data.synthetic_kwargs.n", 1, 2), ("gone", 1, "(not set)"),
                                        ("added", "(not set)", [1])]


def test_an_unreadable_saved_config_is_named_and_changes_nothing(tmp_path, run2):
    (run2 / "config.yaml").write_bytes(b"seed: \xff\xfe\n")
    rc, _, err = go(tmp_path, "--max_steps", "3", "--resume")
    assert rc == 1 and f"--resume: {run2 / 'config.yaml'} (the configuration of the run being continued) is " \
                       "unreadable" in err, err[-2000:]
    assert (run2 / "config.yaml").read_bytes() == b"seed: \xff\xfe\n"


BAD = [b'{"step": 1.5, "loss": \xff\xfe}\n', b'{"step": \n', b'[1, 2]\n', b'{"step": "two"}\n']


def test_bad_metrics_rows_are_moved_aside_before_the_resume_loads(tmp_path, run2):
    path = run2 / "metrics.jsonl"
    good = path.read_bytes().splitlines(keepends=True)
    assert len(good) == 2
    path.write_bytes(good[0] + BAD[0] + BAD[1] + good[1] + BAD[2] + BAD[3] + b'{"step": 3, "cut')  # last: cut by a crash
    rc, out, err = go(tmp_path, "--max_steps", "3", "--resume")
    assert rc == 0, err[-3000:]
    said = [line for line in out.splitlines() if "moved to" in line]
    assert [s.split(": ", 1)[0] for s in said] == [f"[megaforge] {path} line {i}" for i in (2, 3, 5, 6, 7)]
    assert "line 2: not UTF-8 (byte 22)" in said[0] and "line 5: a JSON list, not an object" in said[2]
    assert "line 6: its step is 'two', not a number" in said[3]
    assert out.index("moved to") < out.index("resumed from")
    # nothing lost: the moved lines byte for byte (the cut one given its line end), the rows go on
    assert open(bad_rows_path(str(path)), "rb").read() == b"".join(BAD) + b'{"step": 3, "cut\n'
    assert [r["step"] for r in lines(path)] == [1, 2, 3]


def test_set_aside_keeps_good_files_untouched(tmp_path):
    path = tmp_path / "m.jsonl"
    assert set_aside_bad_rows(str(path)) == []
    path.write_bytes(b'{"step": 1}\n\n{"step": 2.0, "x": NaN}\n')
    st = path.stat()
    assert set_aside_bad_rows(str(path)) == [] and path.stat().st_mtime_ns == st.st_mtime_ns
    assert not os.path.exists(bad_rows_path(str(path)))
