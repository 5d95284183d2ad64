"""The LLM judge through the embedded engine: a scripted tiny judge (its answer is a function of the
prompt's last token) so that the verdicts are known; the template, the parsers, the failures."""
import pytest

from megaforge.config import JudgeConfig, ModelConfig, RewardsConfig, RewardSpec
from megaforge.rewards import RewardManager
from megaforge.rewards.judge import JudgeVerdictError, LLMJudge, check_template, parse_verdict
from model_helpers import TOKENIZER, make_scripted_judge


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    last = lambda text: tok(text, add_special_tokens=False)["input_ids"][-1]  # noqa: E731
    return make_scripted_judge(str(tmp_path_factory.mktemp("judge")), {last("Rate: good"): "9", last("Rate: bad"): "2"})


def judge_cfg(path, **kw):
    base = dict(model=ModelConfig(path=path), template="Rate: {response}", chat_template=False, pattern=r"(\d+)",
                max_new_tokens=6)
    return JudgeConfig(**{**base, **kw})


def test_parse_verdict():
    assert parse_verdict("Score: 3. Upon reflection, Score: 8", "score", r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
                         0, 10, True) == 0.8
    assert parse_verdict("score=8", "score", r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)", 0, 10, False) == 8.0
    assert parse_verdict("Verdict: pass", "pass_fail", r"(?i)verdict\s*[:=]\s*(pass|fail)\b", 0, 1, True) == 1.0
    assert parse_verdict("VERDICT: FAIL", "pass_fail", r"(?i)verdict\s*[:=]\s*(pass|fail)\b", 0, 1, True) == 0.0
    with pytest.raises(JudgeVerdictError, match=r"score 11 outside \[0, 10\]"):
        parse_verdict("Score: 11", "score", r"(?i)score\s*[:=]\s*(-?\d+)", 0, 10, True)
    with pytest.raises(JudgeVerdictError, match="no verdict matching"):
        parse_verdict("I think it is fine", "score", r"(?i)score\s*[:=]\s*(-?\d+)", 0, 10, True)
    with pytest.raises(ValueError, match=r"unknown field \{answer\}"):
        check_template("Judge {answer}")
    check_template("Judge {prompt} / {response} vs {label}; JSON: {{\"score\": N}}")


def test_the_judge_scores_through_the_embedded_engine(judge_dir):
    j = LLMJudge(judge_cfg(judge_dir))
    try:
        out = j.score_batch(["p"] * 4, ["good", "bad", "ugly", "good"], [None] * 4)
        assert out[0] == out[3] == 0.9 and out[1] == 0.2
        assert isinstance(out[2], JudgeVerdictError) and "no verdict matching '(\\\\d+)'" in str(out[2])
        assert j.prompt_ids("p", "good", None) == j.tokenizer("Rate: good")["input_ids"]
        raw = LLMJudge(judge_cfg(judge_dir, normalize=False, score_min=1, score_max=9))
        assert raw.score_batch(["p", "p"], ["good", "bad"], [None, None]) == [9.0, 2.0]
        narrow = LLMJudge(judge_cfg(judge_dir, score_max=5))
        assert "score 9 outside [0, 5]" in str(narrow.score_batch(["p"], ["good"], [None])[0])
        long = j.score_batch(["p"], ["good " * 300], [None])[0]
        assert "the judge prompt has" in str(long) and "context (256)" in str(long)
    finally:
        j.close()


def test_the_judge_in_its_own_worker_beside_the_policy_rewards(judge_dir):
    spec = RewardSpec("llm_judge", weight=2.0, judge=judge_cfg(judge_dir))
    m = RewardManager(RewardsConfig(functions=[RewardSpec("math"), spec], workers=1))
    try:
        assert len(m.pools) == 2 and m.pools[1].batch_sizes == [32]
        totals, metrics = m.score(["p"] * 3, ["good", "bad", "\\boxed{4} ugly"], ["1", "1", "4"])
        assert totals == [2 * 0.9, 2 * 0.2, 1.0] and metrics["reward/errors"] == 1
        assert "reward 'llm_judge' failed on sample 2: JudgeVerdictError: no verdict" in m.last_error
    finally:
        m.close()


def test_bad_judge_settings_are_named(judge_dir, tmp_path):
    with pytest.raises(ValueError, match="judge.template_file '.*missing.txt'"):
        LLMJudge(judge_cfg(judge_dir, template="", template_file=str(tmp_path / "missing.txt")))
    with pytest.raises(ValueError, match="judge.pattern '.*': it has no group"):
        LLMJudge(judge_cfg(judge_dir, pattern=r"\d+"))
