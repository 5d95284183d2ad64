"""examples/llm_judge: the config validates; its rubric and default parser work through the
embedded engine (a tiny scripted judge that answers "Score: 7" after the chat template's generation
prompt); and the CPU demo runs with that judge as a second reward, in a worker of its own, its
samples streamed to the judge while generation continues."""
import dataclasses
import os
import subprocess
import sys

import pytest

from megaforge.config import load_config
from megaforge.rewards.judge import LLMJudge
from model_helpers import make_scripted_judge
from run_helpers import lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "llm_judge")
NEWLINE = 201  # the tiny tokenizer's "\n": the last token of its chat template's generation prompt


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return make_scripted_judge(str(tmp_path_factory.mktemp("judge7")), {NEWLINE: "Score: 7"}, context=1024)


def test_the_example_config_and_rubric_grade_through_the_engine(judge_dir):
    cfg = load_config(["--config", os.path.join(EXAMPLE, "config.yaml")])
    spec = cfg.rewards.functions[1]
    assert spec.name == "llm_judge" and spec.judge.verdict == "score" and cfg.rewards.stream_prompts == 8
    judge_cfg = dataclasses.replace(spec.judge, model=dataclasses.replace(spec.judge.model, path=judge_dir, dtype="float32"),
                                    rollout=dataclasses.replace(spec.judge.rollout, device="cpu"),
                                    template_file=os.path.join(ROOT, spec.judge.template_file), max_new_tokens=16)
    j = LLMJudge(judge_cfg)
    try:
        ids = j.prompt_ids("What is 2+3?", r"2+3=5, \boxed{5}", "#### 5")
        text = j.tokenizer.decode(ids)
        assert text.startswith("<|im_start|>user\nYou are grading") and text.endswith("<|im_start|>assistant\n")
        assert "Reference answer: #### 5" in text and "Student's answer:\n2+3=5, \\boxed{5}" in text
        assert j.score_batch(["q1", "q2"], ["a", "b"], ["1", "2"]) == [0.7, 0.7]
    finally:
        j.close()


@pytest.mark.slow  # ~18 s, the whole example run; the judge in a run: tests/rewards/test_judge.py
def test_the_cpu_demo_with_a_judge_reward_streamed(judge_dir, tmp_path):
    rubric = os.path.join(EXAMPLE, "rubric.txt")
    rewards = (f"[{{name: math, weight: 0.9}}, {{name: llm_judge, weight: 0.5, judge: {{model: {{path: {judge_dir}}}, "
               f"rollout: {{device: cpu}}, template_file: {rubric}, max_new_tokens: 16}}}}]")
    cmd = [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), "--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"),
           "--sft.max_steps", "0", "--max_steps", "2", "--rollout.batch_size", "4", "--grpo.n_samples", "2",
           "--rollout.max_new_tokens", "8", "--metrics.progress", "false", "--metrics.tensorboard", "false",
           "--rewards.functions", rewards, "--rewards.stream_prompts", "1", "--rewards.workers", "1",
           "--output_dir", str(tmp_path), "--run_name", "j"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = lines(os.path.join(tmp_path, "j", "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["reward/llm_judge"] == pytest.approx(0.7) and r["reward/errors"] == 0 and r["reward/timeouts"] == 0
        assert r["reward/mean"] == pytest.approx(0.9 * r["reward/math"] + 0.5 * 0.7)  # mean of sums = sum of means, up to float64 rounding
        assert 0 <= r["time/reward_wait"] <= r["time/reward"]
