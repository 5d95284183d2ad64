"""Before an on-policy distillation run (``algo.advantage: distill``), on any machine holding both models: does the
run's teacher pass the run's own tokenizer check, and how large is the advantage it will give?

    python tools/distill_probe.py --config configs/distill_gsm8k_qwen2.5_0.5b_h200.yaml \
        [--data PATH] [--student DIR] [--teacher DIR] [--prompts 4] [--max_new_tokens N] [--device cpu]

1. ``megaforge.trainer.teacher.check_vocabulary``: the check the trainer makes at start-up (same token -> id map,
   same vocabulary size); a teacher it refuses stops here with its message.
2. The student samples one answer to each of the data's first ``--prompts`` prompts (rendered as the run renders
   them: ``megaforge.data.prompts.parse_row``) at ``grpo.temperature`` (HF ``generate``, top-p 1, no top-k, up to
   ``rollout.max_new_tokens``, seed ``seed``), both models (HF, ``model.dtype`` unless ``--dtype``) score the sampled
   tokens at that temperature, and the per-token reverse KL sample k_t = log pi_student(y_t) - log pi_teacher(y_t)
   (megaforge/algorithms/distill.py: the advantage is -kl_coef * k_t) is summarised: its mean (the reverse KL
   estimate), mean |k|, standard deviation, quantiles, the share of |k| > 1, per answer its length and mean.

``--data`` / ``--student`` / ``--teacher`` replace ``data.path`` / ``model.path`` / ``teacher.path`` (a recipe names
its GPU machine's paths). Prints one JSON line (with provenance). A few answers on a CPU take minutes: the figures
are a scale, not a measurement of the run.
"""
from __future__ import annotations

import argparse
import time

import torch

from common import emit, stage_logger

QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=__doc__.split("\n\n")[1])
    p.add_argument("--config", required=True, help="the distillation run's config")
    p.add_argument("--data", default="", help="replaces data.path")
    p.add_argument("--student", default="", help="replaces model.path")
    p.add_argument("--teacher", default="", help="replaces teacher.path")
    p.add_argument("--prompts", type=int, default=4, help="answers sampled, one per prompt")
    p.add_argument("--max_new_tokens", type=int, default=0, help="0: rollout.max_new_tokens")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="", help="default: model.dtype")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def load(args):
    from megaforge.config import load_config

    over = [f"--{k}={v}" for k, v in (("data.path", args.data), ("model.path", args.student),
                                     ("teacher.path", args.teacher)) if v]
    cfg = load_config(["--config", args.config, *over])
    if cfg.algo.advantage != "distill":
        raise SystemExit(f"distill_probe: {args.config}: algo.advantage is {cfg.algo.advantage!r}, not distill")
    return cfg


def prompts(cfg, tok, n: int) -> list[list[int]]:
    from megaforge.data.prompts import parse_row
    from megaforge.data.sources import read_rows

    out = []
    for raw in read_rows(cfg.data, cfg.seed):
        out.append(parse_row(raw, cfg.data, tok, False).prompt_ids)
        if len(out) == n:
            return out
    raise SystemExit(f"distill_probe: data.path {cfg.data.path!r} has {len(out)} rows, fewer than --prompts {n}")


def token_logprobs(model, prompt: list[int], answer: list[int], temperature: float, device) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) of the answer's tokens at ``temperature``, float32 [len(answer)]
    (megaforge.trainer.logprobs.token_logprobs, the torch backend's own, at the answer's positions)."""
    from megaforge.trainer.logprobs import token_logprobs as aligned_logprobs

    x = torch.tensor([prompt + answer], device=device)
    with torch.no_grad():
        lp, _ = aligned_logprobs(model(x).logits, x, torch.tensor([x.shape[1]], device=device), temperature)
    return lp[0, len(prompt):].cpu()


def summary(k: torch.Tensor) -> dict:
    q = torch.quantile(k, torch.tensor(QUANTILES, dtype=k.dtype))
    return {"tokens": k.numel(), "reverse_kl": round(float(k.mean()), 4), "mean_abs_k": round(float(k.abs().mean()), 4),
            "std_k": round(float(k.std()), 4), "frac_abs_k_gt_1": round(float((k.abs() > 1).float().mean()), 4),
            "quantiles": {str(p): round(float(v), 4) for p, v in zip(QUANTILES, q)}}


def main(argv=None) -> int:
    from megaforge.hf import DTYPES, load_hf_model, load_tokenizer
    from megaforge.trainer.teacher import check_vocabulary, locate, teacher_dtype

    args = parse_args(argv)
    say = stage_logger("distill_probe")
    cfg = load(args)
    device = torch.device(args.device)
    temperature = cfg.grpo.temperature
    tok = load_tokenizer(cfg.model)
    source = locate(cfg.teacher, cfg.model)
    check_vocabulary(cfg.model, source, tok)  # a ConfigError names both tokenizers
    say(f"tokenizer check passed: student {cfg.model.path}, teacher {source.what}")
    rows = prompts(cfg, tok, args.prompts)
    s_dtype = DTYPES[args.dtype or cfg.model.dtype]
    t_dtype = DTYPES[args.dtype or teacher_dtype(cfg.teacher, cfg.model)]
    student = load_hf_model(cfg.model, device, s_dtype).eval()
    torch.manual_seed(cfg.seed)
    t0, answers = time.perf_counter(), []
    new = args.max_new_tokens or cfg.rollout.max_new_tokens
    for p in rows:  # one at a time: no padding to reason about
        with torch.no_grad():
            out = student.generate(torch.tensor([p], device=device), do_sample=True, temperature=temperature, top_p=1.0,
                                   top_k=0, max_new_tokens=new, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
        answers.append(out[0, len(p):].tolist())
    sample_s = time.perf_counter() - t0
    say(f"{len(answers)} answers sampled in {sample_s:.0f} s")
    s_lp = [token_logprobs(student, p, a, temperature, device) for p, a in zip(rows, answers)]
    del student
    if source.state_dict is not None:
        raise SystemExit(f"distill_probe: {source.what}: a run checkpoint; give the teacher as an HF folder (--teacher)")
    teacher = load_hf_model(source.model, device, t_dtype).eval()
    t0 = time.perf_counter()
    t_lp = [token_logprobs(teacher, p, a, temperature, device) for p, a in zip(rows, answers)]
    say(f"teacher scored in {time.perf_counter() - t0:.0f} s")
    k = torch.cat([s - t for s, t in zip(s_lp, t_lp)]).double()
    emit({"tool": "distill_probe", "config": args.config, "student": cfg.model.path, "teacher": cfg.teacher.path,
          "temperature": temperature, "answers": len(answers), "sample_s": round(sample_s, 1), **summary(k),
          "per_answer": [{"tokens": len(a), "reverse_kl": round(float((s - t).mean()), 4),
                          "eos": bool(a) and a[-1] == tok.eos_token_id} for a, s, t in zip(answers, s_lp, t_lp)],
          "student_logprob": round(float(torch.cat(s_lp).mean()), 4),
          "teacher_logprob": round(float(torch.cat(t_lp).mean()), 4)}, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
