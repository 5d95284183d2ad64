#!/usr/bin/env python
"""One colocated GRPO step of a recipe beside the engine alone and the train step alone, in one run.

    torchrun --nproc_per_node 1 tools/bench/bench_grpo_step.py --config configs/grpo_h200_colocated.yaml
    python tools/bench/bench_grpo_step.py --tiny          # CPU: a tiny model and the embedded server, the code path

Prints ONE JSON line (rank 0; progress on stderr). Everything runs on the recipe's own parts (its
trainer, its engines, its memory choreography), with dotted overrides after the flags:

1. ``--steps`` colocated steps through :meth:`megaforge.loop.Run.rl_step` after
   :meth:`~megaforge.loop.Run.start_rl` (engines started while the offload's host buffers are
   pinned, the trainer's weights pushed). ``first_step`` is step 1; ``step`` is the last one.
2. engine alone: the last step's requests (same prompts, sampling parameters and seeds) generated
   again with the trainer offloaded, as during the step: tok/s = sampled tokens / seconds.
3. train alone: the last step's batch trained again (reference logprobs where the recipe uses them,
   the loss, the optimizer step) with the engine's memory released, the trainer resident.
4. raw (megatron backend): megatron-core's pretraining step (tools/bench/raw_megatron.py) on the same model
   and optimizer, over full rows holding as many real tokens as the batch.

Figures and targets: ``overhead`` = (release + onload + offload + sync + resume) / step (<= 0.05);
``step_vs_parts`` = step / (engine alone + train alone) (<= 1.10); the first step's offload
(<= 2 s); ``tokens_per_s_per_gpu`` = all tokens of the step (prompts and responses) / step time /
GPUs; the train step's TFLOP/s against raw megatron-core's (raw_megatron's formula, real tokens);
``limit``: our estimate of the fastest this step's batch could run on the GPU (tools/bench/step_limit.py)
and ``tokens_per_s_vs_limit``, the measured tokens/s as a fraction of it (one known GPU only).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import MODELS, ROOT, Stopwatch, device_name, emit, stage_logger, time_per_call  # noqa: E402
from raw_megatron import flops, raw_microbatches, raw_step  # noqa: E402
from step_limit import hardware, step_limit  # noqa: E402

T0 = time.time()
say = stage_logger("bench_grpo_step")
CHOREOGRAPHY = ("time/release", "time/onload", "time/offload", "time/sync", "time/resume")
TINY = ["--model.config", os.path.join(MODELS, "tiny-qwen2"), "--model.dtype", "float32",
        "--trainer.device", "cpu", "--trainer.layer_spec", "torch", "--trainer.micro_batch_size", "2",
        "--rollout.engine", "embedded_server", "--rollout.device", "cpu", "--rollout.batch_size", "2",
        "--rollout.max_new_tokens", "8", "--rollout.extra_args", "[]", "--rollout.snapshot_dir=",
        "--grpo.n_samples", "2", "--memory.offload", "none", "--sync.transport", "auto"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "grpo_h200_colocated.yaml"))
    p.add_argument("--steps", type=int, default=2, help="colocated steps (>= 2: the first is reported apart)")
    p.add_argument("--raw_steps", type=int, default=2, help="timed raw megatron-core steps (after one warm-up)")
    p.add_argument("--tiny", action="store_true", help="CPU: tiny model, embedded server, the code path only")
    p.add_argument("--limit_gpu", default="", help="estimate the limit for this GPU (e.g. H200) instead of the one "
                   "running (the CPU check of the estimate's path)")
    a, over = p.parse_known_args(argv)
    return a, (TINY if a.tiny else []) + over


def estimate_limit(cfg, batch, dev, world: int, gpu: str = ""):
    """tools/bench/step_limit.py's estimate for this batch on this GPU, or on GPU ``gpu`` when named
    (None off CUDA without ``gpu``, on an unknown GPU or with several ranks: the estimate is for one
    GPU). Prompt / response split of each row: the first trained position; forward-only passes:
    pi_old, plus the reference when the recipe uses it."""
    if world != 1 or not (gpu or dev.type == "cuda"):
        return None
    hw = hardware(gpu or device_name(dev))
    if hw is None:
        return None
    from megaforge.hf import hf_config

    start = (batch.loss_mask > 0).float().argmax(1)
    prompts, lengths = start.tolist(), batch.lengths.tolist()
    return step_limit(hf_config(cfg.model), prompts, [n - p for n, p in zip(lengths, prompts)],
                      cfg.grpo.n_samples, 1 + int(cfg.grpo.beta > 0), *hw)  # the reference: grpo.beta > 0


def recorded(obj, name: str, calls: list):
    """Wrap ``obj.name`` so every call's first argument is appended to ``calls``."""
    orig = getattr(obj, name)

    def wrapper(arg, *rest, **kw):
        calls.append(arg)
        return orig(arg, *rest, **kw)

    setattr(obj, name, wrapper)
    return orig


def phase_sums(m: dict) -> dict:
    keep = {k: round(float(v), 4) for k, v in m.items() if k.startswith(("time/", "memory/", "throughput/"))}
    keep["overhead_s"] = round(sum(float(m.get(k, 0.0)) for k in CHOREOGRAPHY), 4)
    keep["overhead"] = round(keep["overhead_s"] / float(m["time/step"]), 4)
    return keep


def main(argv=None) -> int:
    a, over = parse_args(argv)
    from megaforge import collective
    from megaforge.config import load_config
    from megaforge.metrics import Progress

    out_dir = tempfile.mkdtemp(prefix="bench-grpo-step-")
    cfg = load_config(["--config", a.config, *over, "--output_dir", out_dir, "--run_name", "bench",
                       "--max_steps", str(max(a.steps, 2)), "--checkpoint.interval", "0", "--metrics.progress", "false"])
    from megaforge.loop import Run

    res = {"bench": "grpo_step", "config": os.path.relpath(a.config, ROOT), "overrides": over, "steps": []}
    say("trainer")
    run = Run(cfg, "grpo")
    dev = run.trainer.device
    reqs, batches = [], []
    try:
        say("engines (the offload's host buffers are pinned meanwhile), first weight sync")
        with Stopwatch() as w:
            run.start_rl()
        res["start_rl_s"] = round(w.seconds, 2)
        if run.engine is not None:
            recorded(run.engine, "generate", reqs)
        recorded(run.trainer, "train_step", batches)
        bar = Progress(cfg.max_steps, 0, "bench", False)
        for step in range(1, max(a.steps, 2) + 1):
            reqs.clear()
            batches.clear()
            m = run.rl_step(step, bar)
            run.state["rl_step"] = step
            res["steps"].append(phase_sums(m))
            say(f"step {step}: {m['time/step']:.2f} s (" + ", ".join(f"{k[5:]} {m[k]:.2f}" for k in m if k.startswith("time/")) + ")")
        first, last = res["steps"][0], res["steps"][-1]
        batch = batches[-1]
        tokens = int(batch.lengths.sum())
        res["step"] = last
        res["first_step_offload_s"] = first.get("time/offload", 0.0)
        world = collective.world()
        res["tokens_per_step"] = tokens
        res["tokens_per_s_per_gpu"] = round(tokens / last["time/step"] / world, 1)

        if run.engine is not None:  # 2. the engine alone, on the same requests, trainer offloaded
            flat = [r for call in reqs for r in call]
            with Stopwatch(dev) as w:
                comps = run.engine.generate(flat)
            dt = w.seconds
            sampled = sum(len(c.output_ids) for c in comps)
            res["engine_alone"] = {"seconds": round(dt, 3), "requests": len(flat), "sampled_tokens": sampled,
                                   "tok_s": round(sampled / dt, 1)}
            say(f"engine alone: {dt:.2f} s, {sampled / dt:.0f} tok/s")
            run.engine.release_memory(["weights", "kv_cache"])
        # 3. the train step alone: same batch, trainer resident
        run.trainer.onload()
        again = copy.deepcopy(batch)
        with Stopwatch(dev) as ref:
            if run.parts.settings.needs_ref:
                again.ref_logprobs = run.trainer.compute_logprobs(again, "ref", positions="trained")  # as the loop
        with Stopwatch(dev) as train:
            run.trainer.train_step(again)
        t_ref, t_train = ref.seconds, train.seconds
        res["train_alone"] = {"seconds": round(t_ref + t_train, 3), "ref_logprobs_s": round(t_ref, 3),
                              "train_step_s": round(t_train, 3)}
        say(f"train alone: {t_ref + t_train:.2f} s (reference {t_ref:.2f}, train step {t_train:.2f})")
        parts = res["train_alone"]["seconds"] + res.get("engine_alone", {}).get("seconds", 0.0)
        res["step_vs_parts"] = round(last["time/step"] / parts, 3)

        if cfg.trainer.backend == "megatron":  # 4. raw megatron-core on the same model and optimizer
            from megaforge.hf import hf_config

            hf = hf_config(cfg.model)
            seq, rows = int(batch.lengths.max()), cfg.trainer.micro_batch_size  # full rows as long as the longest
            n_micro = max(1, round(tokens / (seq * rows)))  # about as many tokens as the batch
            data = raw_microbatches(hf.vocab_size, seq, rows, n_micro, dev)
            t_raw = time_per_call(lambda: raw_step(run.trainer, seq, rows, data), 1, a.raw_steps, dev)
            raw_tok = seq * rows * n_micro
            ours = flops(hf, batch.lengths.tolist()) / t_train / world / 1e12
            raw = flops(hf, [seq] * (rows * n_micro)) / t_raw / world / 1e12
            res["raw"] = {"seconds": round(t_raw, 3), "tokens": raw_tok, "seq": seq, "micro_batches": n_micro,
                          "ours_train_tflops_per_gpu": round(ours, 1), "raw_tflops_per_gpu": round(raw, 1),
                          "ratio": round(ours / raw, 3)}
            say(f"raw megatron-core: {t_raw:.2f} s for {raw_tok} tokens; train step {ours:.0f} vs raw {raw:.0f} TFLOP/s")
        limit = estimate_limit(cfg, batch, dev, world, a.limit_gpu)  # our estimate of the fastest this step could run
        if limit is not None:
            res["limit"] = limit
            res["tokens_per_s_vs_limit"] = float(f"{res['tokens_per_s_per_gpu'] / limit['tokens_per_s']:.4g}")
            say(f"limit (train at {limit['frac_of_peak']:.0%} of peak, decode at the bandwidth bound): "
                f"{limit['tokens_per_s']:.0f} tokens/s; measured {res['tokens_per_s_vs_limit']:.2f} of it")
        res["targets"] = {"overhead_le_0.05": last["overhead"] <= 0.05,
                          "step_vs_parts_le_1.10": res["step_vs_parts"] <= 1.10,
                          "first_step_offload_le_2s": res["first_step_offload_s"] <= 2.0}
        if dev.type == "cuda":
            res["device"] = device_name(dev)
    finally:
        run.close_rl()
    res["torch"] = torch.__version__
    res["wall_s"] = round(time.time() - T0, 1)
    if collective.is_main():
        emit(res, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
