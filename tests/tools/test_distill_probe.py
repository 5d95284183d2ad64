"""tools/distill_probe.py on tiny models (the CPU distillation config's tokenizer and data): a teacher equal to the
student gives k_t = 0 on every sampled token, another teacher a reverse KL that is not 0, and a teacher of another
tokenizer stops at the run's own tokenizer check, naming both."""
import json

import pytest
from transformers import AutoTokenizer

import distill_probe
from megaforge.config import ConfigError
from tests.conftest import ROOT, TOKENIZER, make_tiny_model


def probe(capsys, student: str, teacher: str) -> dict:
    rc = distill_probe.main(["--config", "configs/distill_cpu.yaml", "--student", student, "--teacher", teacher,
                             "--prompts", "3", "--max_new_tokens", "12"])
    assert rc == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_teacher_equal_to_the_student_gives_zero_and_another_does_not(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the config's tokenizer path is relative to the checkout
    student = make_tiny_model(str(tmp_path / "student"), seed=0)
    same = probe(capsys, student, student)
    assert same["answers"] == 3 and same["tokens"] == sum(a["tokens"] for a in same["per_answer"]) > 0
    assert same["reverse_kl"] == 0.0 and same["mean_abs_k"] == 0.0 and set(same["quantiles"].values()) == {0.0}
    other = probe(capsys, student, make_tiny_model(str(tmp_path / "teacher"), seed=1))
    assert other["tokens"] == same["tokens"]  # the same samples (seeded), scored by another teacher
    assert other["mean_abs_k"] > 0.01 and other["reverse_kl"] != 0.0
    assert other["student_logprob"] == same["student_logprob"] and other["teacher_logprob"] != same["teacher_logprob"]


def test_teacher_of_another_tokenizer_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    student = make_tiny_model(str(tmp_path / "student"))
    teacher = make_tiny_model(str(tmp_path / "teacher"))
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.add_tokens(["<extra_teacher_token>"])
    tok.save_pretrained(teacher)
    with pytest.raises(ConfigError, match="teacher's tokenizer .*<extra_teacher_token>"):
        distill_probe.main(["--config", "configs/distill_cpu.yaml", "--student", student, "--teacher", teacher])
