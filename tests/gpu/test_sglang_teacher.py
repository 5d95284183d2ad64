"""The distillation teacher served by a real SGLang server (teacher.served_by: engine with teacher.url,
megaforge.trainer.served_teacher): a server holding a tiny random Qwen3 (bf16) is started by
``build_engine``; its prompt log-probs (``/generate`` with ``max_new_tokens`` 0, ``return_logprob``,
``logprob_start_len`` 0) laid out as the teacher's equal the trainer-side teacher's on the same GPU
within the bf16 tolerance of test_sglang_server.py. Figures go to ``$MEGAFORGE_GPU_REPORT_TEACHER``.
"""
from __future__ import annotations

import time

import pytest
import torch

from gpu_helpers import JsonReport, save_tiny_qwen3, sglang_rollout
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(900)
# bf16 serving vs the trainer's bf16 forward of the same weights (test_sglang_server.py: a few 1e-3
# measured on two layers), plus two bf16 spacings of the log-prob itself: the sharpened teacher's
# log-probs reach -46 on average, where one bf16 step is 0.25 (H100, 2026-12-06, code 7a18bf1: max
# |diff| 0.254 against the absolute 0.05 alone, i.e. one step at that size).
LP_MAX_DIFF = 0.05
_report = JsonReport("MEGAFORGE_GPU_REPORT_TEACHER")


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance between neighbouring bf16 numbers at |x|: 2^(floor(log2 |x|) - 7) (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)


def build_served_teacher(cfg, tokenizer=None):
    """megaforge.trainer.served_teacher.build_served_teacher as the trainer calls it (the sections it reads)."""
    from megaforge.trainer.served_teacher import build_served_teacher as build

    return build(cfg.teacher, cfg.model, cfg.rollout, cfg.grpo.temperature, tokenizer)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3-teacher")), seed=3, embed_scale=10.0)


def _cfg(tmp, student, teacher, **teacher_kw):
    from megaforge.config import config_from_dict

    return config_from_dict({
        "output_dir": str(tmp), "run_name": "gpu_teacher", "max_steps": 0, "seed": 0,
        "model": {"path": student, "dtype": "bfloat16"}, "data": {"path": "arithmetic", "format": "synthetic"},
        "algo": {"advantage": "distill" if teacher else "grpo"}, "teacher": {"path": teacher, **teacher_kw},
        "rollout": sglang_rollout(),
        "trainer": {"backend": "torch", "device": "cuda", "micro_batch_size": 8}, "grpo": {"temperature": 1.0},
    })


def test_sglang_prompt_logprobs_are_the_teachers(teacher_dir, tmp_path):
    from megaforge.hf import load_tokenizer
    from megaforge.rollout import build_engine
    from megaforge.trainer.torch_backend import TorchTrainer
    from megaforge.types import TrainBatch

    server_cfg = _cfg(tmp_path, teacher_dir, "")  # a server holding the teacher's weights
    engine = build_engine(RunBuilder(server_cfg).engine_spec(), load_tokenizer(server_cfg.model))
    try:
        url = engine.clients[0].url
        served = build_served_teacher(_cfg(tmp_path, teacher_dir, teacher_dir, served_by="engine", url=url))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, 500, (8, 40), generator=g)
        lengths = torch.tensor([40, 33, 12, 27, 40, 8, 19, 36])
        mask = torch.zeros(tokens.shape)
        for b, n in enumerate(lengths.tolist()):
            mask[b, 4:n] = 1.0
            tokens[b, n:] = 0
        batch = TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=torch.zeros(tokens.shape),
                           rollout_logprobs=torch.zeros(tokens.shape))
        t0 = time.perf_counter()
        got = served.logprobs(batch)
        seconds = time.perf_counter() - t0
        want = TorchTrainer(RunBuilder(_cfg(tmp_path, teacher_dir, teacher_dir)).trainer_spec()).teacher_logprobs(batch)
        err = (got - want).abs()
        bound = LP_MAX_DIFF + 2 * bf16_spacing(want)
        diff = float(err.max())
        report = {"max_lp_diff": diff, "max_lp_diff_over_bound": float((err / bound)[mask > 0].max()),
                  "mean_lp_diff": float(err[mask > 0].mean()), "seconds": round(seconds, 4),
                  "tokens": int(lengths.sum()), "mean_teacher_logprob": float(want[mask > 0].mean())}
        for key, value in report.items():
            _report(key, value)
        print(report)
        assert bool((err <= bound).all()), report
        assert torch.equal(got[mask == 0], torch.zeros_like(got[mask == 0]))
    finally:
        engine.shutdown()
