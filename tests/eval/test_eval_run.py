"""Evaluation inside RL runs of the CPU demo: eval rows at step 0 and every eval.interval steps, the
per-sample files agreeing with the logged metrics, resume keeping the eval history (nothing lost, nothing
twice), an off-policy run through the HTTP engine whose training is unchanged by the evaluations between
its steps, and the same evaluation from the in-process engine. The runs that need no process of their own
run in the test's (eval_helpers.launch_here)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from eval_helpers import EVAL, ROOT, TINY, env, eval_part, launch, launch_here, lines, samples, stable, train_part

from megaforge.eval.stats import mean_pass_at_k


def check_against_samples(run_dir: str, step: int, rec: dict) -> None:
    """The logged metrics are what the per-sample file implies (pass@k recomputed from its verdicts)."""
    recs = samples(os.path.join(run_dir, "eval", "held", f"step_{step:06d}.jsonl"))
    greedy = [r for r in recs if r["mode"] == "greedy"]
    sampled = [r for r in recs if r["mode"] == "sampled"]
    assert len(greedy) == 6 and len(sampled) == 24 and all(r["step"] == step for r in recs)
    assert rec["eval/held/prompts"] == 6
    assert rec["eval/held/greedy/pass@1"] == sum(r["correct"] for r in greedy) / 6
    counts = [sum(r["correct"] for r in sampled if r["prompt_index"] == i) for i in range(6)]
    for k in (1, 2, 4):  # float sums of 6 terms
        assert rec[f"eval/held/sampled/pass@{k}"] == pytest.approx(mean_pass_at_k(counts, 4, k), abs=1e-12)
    for r in recs:
        assert r["correct"] == (r["components"]["even_length"] >= 1.0)
        assert r["correct"] == (len(r["response"]) % 2 == 0)
        # reward = 1.0 * even_length + 0.5 * math (float sum of two terms)
        assert r["reward"] == pytest.approx(r["components"]["even_length"]
                                            + 0.5 * r["components"]["math"], abs=1e-12)
    assert rec["eval/held/sampled/reward/even_length"] == pytest.approx(
        sum(r["correct"] for r in sampled) / 24, abs=1e-12)
    assert rec["eval/held/greedy/response_len/mean"] == pytest.approx(sum(r["response_len"] for r in greedy) / 6,
                                                                      abs=1e-12)


def test_eval_rows_samples_and_resume(tmp_path):
    out = str(tmp_path)
    first = launch_here(out, "a", "--max_steps", "4", "--checkpoint.interval", "2", "--eval.interval", "2", *EVAL)
    run = os.path.join(out, "a")
    assert [r["step"] for r in first] == [0, 1, 2, 3, 4]
    assert set(first[0]) == {"step", "time/eval"} | set(eval_part(first[0]))  # step 0: the evaluation only
    assert [bool(eval_part(r)) for r in first] == [True, False, True, False, True]
    for r in (first[0], first[2], first[4]):
        check_against_samples(run, r["step"], r)
    # greedy responses differ between steps only through training: the policy changed
    assert first[0]["eval/weight_version"] < first[2]["eval/weight_version"] < first[4]["eval/weight_version"]
    assert sorted(os.listdir(os.path.join(run, "eval", "held"))) == [f"step_00000{i}.jsonl" for i in (0, 2, 4)]

    # SIGTERM inside step 2, an evaluation step and a checkpoint step: the stopped run writes step 2's row
    # without its evaluation and one checkpoint; the resumed run evaluates step 2's weights first, into
    # that row, and goes on: the same metrics as the run that was never stopped
    stopping = ["--rewards.functions", "[{name: 'eval_helpers:even_length_stopping', label: even_length, "
                "weight: 1.0}, {name: math, weight: 0.5}]", "--rewards.workers", "1",
                "--eval.correct_reward", "even_length"]  # its label
    args = [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), *TINY, "--output_dir", out,
            "--run_name", "b", "--max_steps", "4", "--checkpoint.interval", "2", "--eval.interval", "2", *EVAL,
            *stopping]
    stopped_rows = os.path.join(out, "b", "metrics.jsonl")
    p = subprocess.run(args, cwd=ROOT, env=dict(env(), MF_TEST_STOP_ROWS=f"{stopped_rows}:2"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 143, p.stdout[-3000:] + p.stderr[-3000:]
    assert "SIGTERM received: stopped after RL step 2" in p.stderr
    assert "the evaluation of step 2 runs first in the resumed run" in p.stdout
    assert p.stdout.count("checkpoints/step_") == 1 and "checkpoints/step_000002" in p.stdout  # not twice
    stopped = lines(stopped_rows)
    assert [r["step"] for r in stopped] == [0, 1, 2] and not eval_part(stopped[2])
    assert stable(stopped[:2]) == stable(first[:2])
    resumed_b = launch_here(out, "b", "--max_steps", "4", "--checkpoint.interval", "2", "--eval.interval", "2",
                       "--resume", *EVAL, *stopping)
    assert stable(resumed_b) == stable(first)
    check_against_samples(os.path.join(out, "b"), 2, resumed_b[2])

    # lose the step-4 checkpoint: the resume goes back to step 2, redoes 3 and 4 and goes on to 6
    shutil.rmtree(os.path.join(run, "checkpoints", "step_000004"))
    resumed = launch_here(out, "a", "--max_steps", "6", "--checkpoint.interval", "2", "--eval.interval", "2", "--resume",
                     *EVAL)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5, 6]
    assert [bool(eval_part(r)) for r in resumed] == [True, False, True, False, True, False, True]
    # the history before the checkpoint is kept as written, the redone steps are the same steps
    assert stable(resumed[:5]) == stable(first)
    check_against_samples(run, 6, resumed[6])


@pytest.mark.slow
def test_http_engine_and_off_policy_training_unchanged_by_evaluations(tmp_path):
    # a file set of sums the demo never trains on (operands > 9), so both runs train on the same data
    path = tmp_path / "big_sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)}) + "\n"
                            for a in range(10, 16)))
    out = str(tmp_path)
    args = ["--max_steps", "3", "--rollout.engine", "embedded_server", "--loop.mode", "off_policy"]
    plain = launch(out, "plain", *args)
    with_eval = launch(out, "evald", *args, "--eval.interval", "1", *EVAL[2:],
                       "--eval.sets", f"[{{name: held, path: {path}}}]")
    assert [r["step"] for r in with_eval] == [0, 1, 2, 3]
    assert all(eval_part(r) for r in with_eval)
    check_against_samples(os.path.join(out, "evald"), 2, with_eval[2])
    # the starting policy evaluated through the in-process engine: the same numbers as over HTTP
    direct = launch(out, "direct", "--max_steps", "1", *EVAL[2:], "--eval.sets", f"[{{name: held, path: {path}}}]")
    assert eval_part(direct[0]) == eval_part(with_eval[0]) and len(eval_part(direct[0])) >= 15
    assert [train_part(r) for r in with_eval[1:]] == [train_part(r) for r in plain]
    # the engine serves the version pushed before the step's rollout: one update behind the trainer
    assert [r["eval/weight_version"] for r in with_eval[1:]] == [r["engine/weight_version"] for r in plain]
