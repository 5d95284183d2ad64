"""The distillation teacher served by an engine (teacher.served_by: engine, megaforge.trainer.served_teacher):
the embedded engine's and an SGLang server's (the HTTP double of tests/sglang_double.py, serving the
teacher's own HF model) prompt log-probs laid out as the trainer-side teacher's, equal to them; the
config's checks; the tokenizer check kept; and a 2-step distillation run with the engine teacher
matching the trainer-side teacher's run."""
import json
import os

import pytest
import torch
from sglang_double import SGLangDouble

from megaforge.build import RunBuilder
from megaforge.config import ConfigError, config_from_dict
from megaforge.types import TrainBatch
from tests.conftest import TOKENIZER
from tests.run_helpers import run_in_process

# Both sides run the same float32 weights on the CPU; they differ in batch layout (the engine: whole
# rows right-padded, max_batch rows per forward; the trainer: its own micro-batches, the LM head at
# trained positions only) and so in the summation order of matmuls and SDPA: float32 rounding,
# ~1e-7 relative per op; this teacher's log-probs reach ~45 in magnitude (its LM head scaled 30x), and
# the largest difference measured was 7.6e-6 (2026-12-05, temperature 0.7). A real difference (another
# temperature, an off-by-one position) moves them by > 1e-2.
TOL = 2e-5


def build_served_teacher(cfg, tokenizer=None):
    """megaforge.trainer.served_teacher.build_served_teacher as the trainer calls it (the sections it reads)."""
    from megaforge.trainer.served_teacher import build_served_teacher as build

    return build(cfg.teacher, cfg.model, cfg.rollout, cfg.grpo.temperature, tokenizer)


def cfg_of(student, teacher, _temperature=1.0, **teacher_kw):
    return config_from_dict({"model": {"path": student, "tokenizer": TOKENIZER},
                             "data": {"path": "arithmetic", "format": "synthetic"},
                             "algo": {"advantage": "distill"}, "teacher": {"path": teacher, **teacher_kw},
                             "grpo": {"temperature": _temperature},
                             "rollout": {"engine_batch_size": 4},
                             "trainer": {"device": "cpu", "micro_batch_size": 4}})


def batch_of(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 500, (6, 12), generator=g)
    lengths = torch.tensor([12, 9, 7, 12, 5, 10])
    mask = torch.zeros(6, 12)
    for i, n in enumerate(lengths.tolist()):
        mask[i, 3:n] = 1.0
        tokens[i, n:] = 0
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=torch.zeros(6, 12),
                      rollout_logprobs=torch.zeros(6, 12))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from tests.conftest import make_tiny_model

    from transformers import AutoModelForCausalLM

    d = make_tiny_model(str(tmp_path_factory.mktemp("teacher")), seed=7, tie=False, num_hidden_layers=4)
    m = AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():  # a sharp distribution, far from the random student's near-uniform one
        m.lm_head.weight.mul_(30.0)
    m.save_pretrained(d)
    return d


def test_config_checks(tiny_model_dir):
    with pytest.raises(ConfigError, match="'teacher.url': is the SGLang server of a teacher served by an engine"):
        cfg_of(tiny_model_dir, tiny_model_dir, url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="'teacher.url': 'localhost:1' is not an http"):
        cfg_of(tiny_model_dir, tiny_model_dir, served_by="engine", url="localhost:1")
    with pytest.raises(ConfigError, match="'teacher.url': SGLang's prompt log-probs are of the raw logits"):
        cfg_of(tiny_model_dir, tiny_model_dir, served_by="engine", url="http://h:1", _temperature=0.7)
    with pytest.raises(ConfigError, match="'teacher.served_by'"):
        cfg_of(tiny_model_dir, tiny_model_dir, served_by="gpu")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_embedded_engine_teacher_equals_the_trainers(tiny_model_dir, teacher_dir, tokenizer, temperature):
    from megaforge.trainer.torch_backend import TorchTrainer

    batch = batch_of()
    on_trainer = TorchTrainer(RunBuilder(cfg_of(tiny_model_dir, teacher_dir, _temperature=temperature)).trainer_spec(), tokenizer)
    served = TorchTrainer(RunBuilder(cfg_of(tiny_model_dir, teacher_dir, served_by="engine", _temperature=temperature)).trainer_spec(), tokenizer)
    assert served.teacher is None and served.served_teacher is not None  # no copy on the trainer
    want = on_trainer.teacher_logprobs(batch)
    got = served.teacher_logprobs(batch)
    trained = batch.loss_mask > 0
    assert bool((want[trained] < 0).all()) and torch.equal(got[~trained], torch.zeros_like(got[~trained]))
    assert float((got - want).abs().max()) < TOL
    policy = on_trainer.compute_logprobs(batch, "policy", "trained")  # the student: another model
    assert float((policy - want).abs().max()) > 1e-2


def test_sglang_teacher_equals_the_trainers(tiny_model_dir, teacher_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from megaforge.trainer.torch_backend import TorchTrainer

    double = SGLangDouble(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()).start()
    try:
        batch = batch_of(1)
        served = build_served_teacher(cfg_of(tiny_model_dir, teacher_dir, served_by="engine", url=double.url),
                                      tokenizer)
        got = served.logprobs(batch)
        endpoint, body = double.calls[-1]
        assert endpoint == "/generate" and body["logprob_start_len"] == 0 and body["return_logprob"] is True
        assert body["sampling_params"] == [{"max_new_tokens": 0}] * 6
        assert body["input_ids"] == [batch.tokens[b, :n].tolist() for b, n in enumerate(batch.lengths.tolist())]
        want = TorchTrainer(RunBuilder(cfg_of(tiny_model_dir, teacher_dir)).trainer_spec(), tokenizer).teacher_logprobs(batch)
        assert float((got - want).abs().max()) < TOL
    finally:
        double.stop()


def test_tokenizer_check_stays_for_the_engine_teacher(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoTokenizer

    from tests.conftest import make_tiny_model

    other = make_tiny_model(str(tmp_path / "teacher"))
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.add_tokens(["<extra_teacher_token>"])
    tok.save_pretrained(other)
    for kw in ({}, {"url": "http://127.0.0.1:9"}):  # checked before any engine is asked
        with pytest.raises(ConfigError, match="'teacher.path': the teacher's tokenizer"):
            build_served_teacher(cfg_of(tiny_model_dir, other, served_by="engine", **kw), tokenizer)


def test_two_step_distill_run_with_the_engine_teacher(tmp_path, teacher_dir):
    """The CPU distillation config for 2 steps, teacher on the trainer vs served by the embedded engine:
    the same samples (same seed) and so the same teacher log-probs and reverse KL per step, within TOL
    (a mean over the batch's tokens of values that each agree within TOL)."""
    rows = {}
    for served_by in ("trainer", "engine"):
        rc, out, err = run_in_process("grpo", [
            "--config", "configs/distill_cpu.yaml", "--teacher.path", teacher_dir, "--teacher.served_by", served_by,
            "--output_dir", str(tmp_path / "runs"), "--run_name", served_by, "--sft.max_steps", "0",
            "--max_steps", "2", "--rollout.batch_size", "8", "--metrics.tensorboard", "false"])
        assert rc == 0, err[-3000:]
        rows[served_by] = [json.loads(ln) for ln in open(os.path.join(tmp_path, "runs", served_by, "metrics.jsonl"))]
    assert [r["weight_version"] for r in rows["engine"]] == [1.0, 2.0]
    for a, b in zip(rows["trainer"], rows["engine"]):
        assert b["distill/reverse_kl"] > 0
        for k in ("distill/teacher_logprob", "distill/reverse_kl"):
            assert abs(a[k] - b[k]) < TOL, (k, a[k], b[k])
