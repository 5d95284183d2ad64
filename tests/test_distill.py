"""On-policy distillation (issue 43 point 5): the distill advantage's formula on hand-computed values,
a teacher equal to the student giving exactly zero KL advantage, a teacher of another tokenizer
refused at start-up naming both tokenizers, the config's checks, and a short torch-backend run."""
import json
import os

import pytest
import torch

from megaforge.algorithms import ADVANTAGES, AdvantageInputs, ObjectiveParams
from megaforge.config import ConfigError, config_from_dict
from megaforge.build import RunBuilder
from megaforge.driver.steps import batch_advantages
from megaforge.types import TrainBatch
from tests.conftest import TOKENIZER
from tests.run_helpers import run_in_process

DATA = {"data": {"path": "arithmetic", "format": "synthetic"}}


def inputs(**kw):
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    student = torch.tensor([[0.0, -0.5, -1.0, 0.0], [0.0, -2.0, -0.1, -0.3]])
    teacher = torch.tensor([[0.0, -1.5, -0.25, 0.0], [0.0, -0.5, -0.1, -1.3]])
    return AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]), loss_mask=mask,
                           logprobs=student, teacher_logprobs=teacher, **kw)


def test_formula_hand_computed():
    # k = student - teacher on trained tokens: row 0 [1.0, -0.75], row 1 [-1.5, 0.0, 1.0]; A = -coef * k
    adv = ADVANTAGES.get("distill")(inputs(), ObjectiveParams.of_values(distill_kl_coef=0.5))
    want = torch.tensor([[0.0, -0.5, 0.375, 0.0], [0.0, 0.75, 0.0, -0.5]])
    assert torch.allclose(adv, want, atol=1e-7, rtol=0)  # float32 arithmetic on exact binary fractions
    # combined with the task reward: grpo of rewards [1, 0] in one group: (r - 0.5) / (std 0.7071 + eps)
    p = ObjectiveParams.of_values(distill_kl_coef=0.5, distill_task_coef=2.0, std_eps=0.0)
    adv = ADVANTAGES.get("distill")(inputs(), p)
    a = 0.5 / 0.5 ** 0.5
    task = torch.tensor([[0.0, a, a, 0.0], [0.0, -a, -a, -a]])
    assert torch.allclose(adv, want + 2.0 * task, atol=1e-6, rtol=0)  # float32 rounding of the grpo term


def test_missing_logprobs_refused():
    inp = AdvantageInputs(rewards=torch.tensor([1.0]), group_ids=torch.tensor([0]), loss_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="student's .pi_old. or the teacher's log-probs"):
        ADVANTAGES.get("distill")(inp, ObjectiveParams())


def cfg_of(teacher_path, **extra):
    return config_from_dict({"model": {"path": teacher_path["student"], "tokenizer": TOKENIZER}, **DATA,
                             "algo": {"advantage": "distill"}, "teacher": {"path": teacher_path["teacher"]},
                             "trainer": {"device": "cpu", "micro_batch_size": 4}, **extra})


def test_config_checks(tiny_model_dir):
    with pytest.raises(ConfigError, match="'teacher.path': algo.advantage distill needs a teacher"):
        config_from_dict({"model": {"path": tiny_model_dir}, **DATA, "algo": {"advantage": "distill"}})
    with pytest.raises(ConfigError, match="'teacher.path': a teacher is set but algo.advantage is 'grpo'"):
        config_from_dict({"model": {"path": tiny_model_dir}, **DATA, "teacher": {"path": tiny_model_dir}})
    with pytest.raises(ConfigError, match="'teacher.kl_coef': and teacher.task_coef are both 0"):
        cfg_of({"student": tiny_model_dir, "teacher": tiny_model_dir}, teacher={"path": tiny_model_dir, "kl_coef": 0.0})
    cfg = cfg_of({"student": tiny_model_dir, "teacher": tiny_model_dir})
    s = RunBuilder(cfg).step_settings()
    assert s.needs_old_logprobs and s.advantages_need_trainer


def test_teacher_equal_to_student_gives_zero_kl_advantage(tiny_model_dir, tokenizer):
    from megaforge.trainer.torch_backend import TorchTrainer

    cfg = cfg_of({"student": tiny_model_dir, "teacher": tiny_model_dir})
    tr = TorchTrainer(RunBuilder(cfg).trainer_spec(), tokenizer)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 500, (6, 10), generator=g)
    lengths = torch.tensor([10, 9, 7, 10, 5, 8])
    mask = torch.zeros(6, 10)
    for i, n in enumerate(lengths.tolist()):
        mask[i, 4:n] = 1.0
    batch = TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=torch.zeros(6, 10),
                       rollout_logprobs=torch.zeros(6, 10), rewards=torch.tensor([1.0, 0, 1, 0, 1, 0]),
                       group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    batch.old_logprobs = tr.compute_logprobs(batch, "policy", positions="trained")
    teacher = tr.compute_logprobs(batch, "teacher", positions="trained")
    assert bool((batch.old_logprobs[mask > 0] < 0).all())  # real log-probs, not zeros
    adv = batch_advantages(batch, RunBuilder(cfg).step_settings(), teacher_logprobs=teacher)
    assert torch.equal(adv, torch.zeros_like(adv))  # same weights, same kernel: k_t = 0 exactly
    # a different teacher (the student after one SGD nudge) does give a nonzero advantage
    with torch.no_grad():
        for p in tr.teacher.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    teacher = tr.compute_logprobs(batch, "teacher", positions="trained")
    assert float(batch_advantages(batch, RunBuilder(cfg).step_settings(), teacher_logprobs=teacher).abs().sum()) > 0


def test_tokenizer_mismatch_refused_naming_both(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    other = tmp_path / "teacher"
    from tests.conftest import make_tiny_model

    make_tiny_model(str(other))
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.add_tokens(["<extra_teacher_token>"])
    tok.save_pretrained(str(other))
    rc, out, err = run_in_process("grpo", [
        "--config", "configs/distill_cpu.yaml", "--teacher.path", str(other), "--output_dir", str(tmp_path / "runs"),
        "--sft.max_steps", "0", "--max_steps", "1"])
    assert rc != 0
    line = [ln for ln in err.splitlines() if ln.startswith("megaforge: config error:")]
    assert line, err[-2000:]
    assert "teacher.path" in line[0] and str(other) in line[0] and "assets/tiny-tokenizer" in line[0], line[0]
    assert "<extra_teacher_token>" in line[0]


def test_short_torch_run_trains(tmp_path):
    """Four distillation steps of the CPU config (its 4-layer student, random init) toward another
    architecture of the same vocabulary (a 2-layer tiny model whose LM head is scaled 30x: a sharp
    distribution, far from the student's near-uniform one): the student takes optimizer steps on a
    positive reverse KL to the teacher, and the KL falls."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_tiny_model

    teacher = make_tiny_model(str(tmp_path / "teacher"), tie=False)
    m = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)
    m.save_pretrained(teacher)
    rc, out, err = run_in_process("grpo", [
        "--config", "configs/distill_cpu.yaml", "--teacher.path", teacher,
        "--output_dir", str(tmp_path / "runs"), "--run_name", "d",
        "--sft.max_steps", "0", "--max_steps", "4", "--trainer.lr", "3e-3", "--rollout.batch_size", "8"])
    assert rc == 0, err[-3000:]
    rows = [json.loads(ln) for ln in open(os.path.join(tmp_path, "runs", "d", "metrics.jsonl"))]
    assert [r["weight_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    kl = [r["distill/reverse_kl"] for r in rows]
    print("reverse KL per step", kl)
    assert all(k > 0 for k in kl)
    assert kl[-1] < kl[0]
