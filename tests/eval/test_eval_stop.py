"""A stop signal (SIGTERM) during an evaluation: the evaluation is abandoned before its next engine call
(nothing of it written), the run checkpoints the step it evaluated and stops without another RL step;
the resumed run evaluates that step first (stopped there again by another signal, it stops again with
the same checkpoint) and ends as the run never stopped. A signal during the
evaluation's last engine call lets it finish and stops the run right after it. The signal comes from the
run's own reward worker while it scores the evaluation's first engine call (eval_helpers), so what ran is
asserted (rows, files, the checkpoint's state), never how long it took. The runs are in this process."""
import json
import os

import pytest
from eval_helpers import TINY, eval_part, lines, run_in_process, stable

ROWS = [{"prompt": f"What is {a} + {a + 11}?", "answer": "STOP"} for a in range(10, 13)]


def go(out, name, *extra):
    return run_in_process("grpo", [*TINY, "--output_dir", str(out), "--run_name", name, *extra])


def without_eval(recs):
    return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in stable(recs)]


# before_train: the signal in the step-0 evaluation; step: in step 1's, which has a second engine call
# (greedy, then sampled) that is never made; last_call: greedy only, one engine call, which finishes
@pytest.mark.parametrize("case", ["before_train", "step", "last_call"])
def test_sigterm_during_an_evaluation_stops_at_its_step(tmp_path, monkeypatch, case):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["--sft.max_steps", "0", "--max_steps", "2", "--eval.interval", "1",
            "--eval.sets", f"[{{name: held, path: '{held}'}}]", "--eval.before_train", str(case == "before_train"),
            "--eval.n_samples", "0" if case == "last_call" else "2", "--eval.pass_k", "[]",
            "--rewards.workers", "1", "--eval.correct_reward", "even_length",
            "--rewards.functions", "[{name: 'eval_helpers:even_length_stop_in_eval', label: even_length, "
            "weight: 1.0}, {name: math, weight: 0.5}]"]
    first = 0 if case == "before_train" else 1
    reference = None
    if case == "step":  # the run that is never stopped (the other cases: the same code, no second comparison)
        monkeypatch.delenv("MF_TEST_STOP_IN_EVAL", raising=False)
        rc, _, err = go(tmp_path, "ref", *args)
        assert rc == 0, err[-3000:]
        reference = lines(tmp_path / "ref" / "metrics.jsonl")
        assert [r["step"] for r in reference] == [1, 2] and all(map(eval_part, reference))

    marker = tmp_path / "stop_sent"
    monkeypatch.setenv("MF_TEST_STOP_IN_EVAL", str(marker))
    rc, out, err = go(tmp_path, "s", *args)
    run = tmp_path / "s"
    assert rc == 143 and marker.exists(), out[-3000:] + err[-3000:]
    assert f"SIGTERM received: stopped after RL step {first}" in err
    rows = lines(run / "metrics.jsonl")
    state = json.loads((run / "checkpoints" / f"step_00000{first}" / "state.json").read_text())
    assert os.listdir(run / "checkpoints") == [f"step_00000{first}"] and state["rl_step"] == first
    evaluated = sorted(os.listdir(run / "eval" / "held")) if (run / "eval" / "held").exists() else []
    if case == "last_call":  # the evaluation finished, in row 1; no step 2
        assert [r["step"] for r in rows] == [1] and eval_part(rows[0]) and "eval_pending" not in state
        assert evaluated == ["step_000001.jsonl"]
    else:  # abandoned: nothing of it written, no further step; deferred to the resumed run
        assert f"stop requested during the evaluation of step {first}: abandoned" in out
        assert [r["step"] for r in rows] == list(range(1, first + 1)) and not any(map(eval_part, rows))
        assert evaluated == [] and state.get("eval_pending") == (None if first == 0 else 1)
        if reference is not None:
            assert without_eval(rows) == without_eval(reference[:1])

    if case == "step":  # a second signal during the deferred evaluation: stopped again, nothing changed
        saved = (run / "checkpoints" / "step_000001" / "state.json").read_text()
        marker.unlink()
        rc, out, err = go(tmp_path, "s", *args, "--resume")
        assert rc == 143 and marker.exists() and "SIGTERM received: stopped after RL step 1" in err, err[-3000:]
        assert "stop requested during the evaluation of step 1: abandoned" in out
        assert without_eval(lines(run / "metrics.jsonl")) == without_eval(reference[:1])
        assert not any(map(eval_part, lines(run / "metrics.jsonl"))) and not (run / "eval" / "held").exists()
        assert os.listdir(run / "checkpoints") == ["step_000001"]
        assert (run / "checkpoints" / "step_000001" / "state.json").read_text() == saved

    # the resume (evaluating the stopped step first where it was abandoned) ends as the run never stopped
    rc, out, err = go(tmp_path, "s", *args, "--resume")
    assert rc == 0, err[-3000:]
    resumed = lines(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(first, 3)) and all(map(eval_part, resumed))
    if reference is not None:
        assert stable(resumed) == stable(reference)
    assert sorted(os.listdir(run / "eval" / "held")) == [f"step_00000{i}.jsonl" for i in range(first, 3)]
