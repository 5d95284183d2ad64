"""The dry-run planner's memory estimate beside the measured peak, per phase, on a CUDA machine.

    torchrun --nproc_per_node 1 tools/bench/check_memory_estimate.py --model_config configs/models/qwen3-1.7b
    torchrun --nproc_per_node 2 tools/bench/check_memory_estimate.py --tp 2 --sp      # a second layout
    python tools/bench/check_memory_estimate.py --cpu_smoke                           # CPU: the code path only
    torchrun --nproc_per_node 1 tools/bench/check_memory_estimate.py --model_config configs/models/qwen2.5-7b \
        --lora_rank 16 --no_rollout                   # a 7B LoRA policy's train step (issue 43 point 4)
    python tools/bench/check_memory_estimate.py --predict_only --measured docs/benchmarks/check_memory_estimate_h200.jsonl
                                     # no GPU: today's planner against the peaks measured in that file

What runs is a colocated RL step of megaforge's own parts with a random-init model built from the
HF ``config.json`` (no download): the Megatron trainer (``trainer.backend megatron`` at the given
layout) and the embedded engine in the rank-0 process, as ``rollout.engine: embedded`` does.

1. warm-up: one train step (so the Adam moments exist, as in every step after the first);
2. rollout phase: trainer offloaded (``--offload pinned``) or left resident (``none``), the
   embedded engine built on rank 0 and generating ``--prompts x --n_samples`` sequences of
   ``--prompt_len`` random prompt tokens + exactly ``--new_tokens`` sampled tokens (no stop token);
   the engine then releases its weights and KV cache, as the loop does;
3. train phase: trainer onloaded; the reference logprobs (``--beta`` > 0) and one RL train step on
   full-length sequences (the planner's worst case).

``torch.cuda.max_memory_allocated`` is reset before each phase and read after it; the maximum over
ranks is compared with the planner's prediction for the same config (``megaforge.planner``:
rollout = the phase's allocated bytes, train = the trainer's bytes of the train phase). One JSON
line: predicted and measured GiB and the relative error (predicted - measured) / measured per phase.
With ``--cpu_smoke`` a tiny shape runs on CPU (float32): measured values are null.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import MODELS, ROOT, PeakMemory, device_name, emit, rl_batch, stage_logger  # noqa: E402

progress = stage_logger("check_memory_estimate")  # a run cut by a time limit still shows how far it got


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_config", default=os.path.join(MODELS, "qwen3-1.7b"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--layer_spec", default="torch", choices=["auto", "te", "torch"])
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--micro_batch_size", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n_samples", type=int, default=4)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=768)
    p.add_argument("--engine_batch_size", type=int, default=64)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient: > 0 adds the reference model")
    p.add_argument("--offload", default="pinned", choices=["pinned", "none"])
    p.add_argument("--no_rollout", action="store_true", help="skip the embedded-engine rollout phase")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="> 0: a LoRA policy (model.lora, megatron adapters): rank of every adapter")
    p.add_argument("--lora_alpha", type=float, default=32.0)
    p.add_argument("--lora_targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="model.lora.target_modules, comma-separated")
    p.add_argument("--cpu_smoke", action="store_true", help="tiny shape on CPU; measured values are null")
    p.add_argument("--predict_only", action="store_true",
                   help="no GPU: the planner's prediction for every layout of --measured (one JSON line each)")
    p.add_argument("--measured", default=None, help="JSON lines of earlier GPU runs of this tool (--predict_only)")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.model_config = os.path.join(MODELS, "tiny-qwen2")
        a.dtype, a.prompts, a.n_samples, a.prompt_len, a.new_tokens = "float32", 2, 2, 8, 8
        a.micro_batch_size, a.engine_batch_size = 2, 4
    return a


def build_config(a, device: str, engine: str = "embedded"):
    """The run config of the measured step (``engine`` embedded); ``engine="sglang"``: the same run with
    SGLang colocated (rollout.mem_fraction 0.5), for the planner's verdict on that layout."""
    from megaforge.config import RolloutConfig, config_from_dict

    rollout = {"engine": engine, "batch_size": a.prompts, "max_new_tokens": a.new_tokens,
               "engine_batch_size": a.engine_batch_size, "device": device}
    if engine == "sglang":
        rollout["mem_fraction"] = 0.5
    elif any(f.name == "fast" for f in dataclasses.fields(RolloutConfig)):
        rollout["fast"] = "off"  # the planner models the embedded engine's DynamicCache loop
    model = {"config": a.model_config, "dtype": a.dtype, "attn_implementation": "sdpa"}
    if a.lora_rank > 0:
        model["lora"] = {"rank": a.lora_rank, "alpha": a.lora_alpha, "target_modules": a.lora_targets.split(",")}
    return config_from_dict({
        "max_steps": 1, "seed": 0,
        "model": model,
        "data": {"path": "arithmetic", "format": "synthetic", "max_prompt_len": a.prompt_len},
        "grpo": {"n_samples": a.n_samples, "beta": a.beta, "temperature": 1.0},
        "rollout": rollout,
        "trainer": {"backend": "megatron", "device": device, "tensor_parallel": a.tp, "pipeline_parallel": a.pp,
                    "context_parallel": a.cp, "sequence_parallel": a.sp, "layer_spec": a.layer_spec,
                    "recompute": a.recompute, "micro_batch_size": a.micro_batch_size, "mini_batches": 1,
                    "lr": 1e-6, "grad_clip": 1.0},
        "memory": {"offload": a.offload},
    })


def full_length_batch(cfg, vocab: int, seed: int = 0):
    """prompts x n_samples rows of prompt_len + new_tokens tokens, the loss on the response."""
    B = cfg.rollout.batch_size * cfg.grpo.n_samples
    P, N = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
    return rl_batch(torch.full((B,), P + N), vocab, P, seed=seed)


def rollout_requests(cfg, vocab: int, seed: int = 1):
    from megaforge.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(cfg.rollout.batch_size):
        ids = torch.randint(0, vocab, (cfg.data.max_prompt_len,), generator=g).tolist()
        for j in range(cfg.grpo.n_samples):
            sp = SamplingParams(temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=[], seed=i * 1000 + j)
            out.append(GenerateRequest(ids, sp, rid=f"{i}-{j}"))
    return out


def compare(pred: float, meas):
    if meas is None:
        return {"predicted_gib": round(pred, 3), "measured_gib": None, "rel_error": None}
    return {"predicted_gib": round(pred, 3), "measured_gib": round(meas, 3), "rel_error": round((pred - meas) / meas, 4)}


def phase_report(phases: dict, measured: dict) -> dict:
    """Per phase: the planner's prediction (``make_plan(...)["phases"]``) beside the measured GiB
    (``measured``: phase -> GiB or None; the rollout only when it ran) and its items."""
    out = {}
    if "rollout" in measured:
        out["rollout"] = compare(phases["rollout"]["allocated_gib"], measured["rollout"])
        out["rollout"]["predicted_items_gib"] = phases["rollout"]["items"]
    out["train"] = compare(phases["train"]["trainer_allocated_gib"], measured["train"])
    out["train"]["predicted_items_gib"] = {k: v for k, v in phases["train"]["items"].items() if "engine" not in k}
    return out


def predict_only(a) -> int:
    """Re-predict each layout of ``a.measured`` with the current planner; measured peaks as recorded."""
    from megaforge.build import RunBuilder
    from megaforge.planner import make_plan

    if not a.measured:
        raise SystemExit("--predict_only needs --measured FILE (JSON lines written by this tool on a GPU)")
    with open(a.measured) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    for i, run in enumerate(runs):
        lay = run["layout"]
        args = parse_args(["--model_config", os.path.join(ROOT, run["model_config"]), "--dtype", run["dtype"],
                           "--tp", str(lay["tp"]), "--pp", str(lay["pp"]), "--cp", str(lay["cp"]),
                           "--layer_spec", lay["layer_spec"], "--recompute", lay["recompute"],
                           "--micro_batch_size", str(lay["micro_batch_size"]), "--offload", lay["offload"],
                           "--beta", str(lay["beta"])] + (["--sp"] if lay["sp"] else [])
                          + (["--lora_rank", str(lay["lora"]["rank"]), "--lora_alpha", str(lay["lora"]["alpha"]),
                              "--lora_targets", ",".join(lay["lora"]["target_modules"])] if lay.get("lora") else []))
        cfg = build_config(args, "cuda")
        plan = make_plan(RunBuilder(cfg).plan_input(), "grpo", {"nodes": 1, "gpus_per_node": run["world_size"], "gpu": run["device"],
                                       "gpu_memory_gib": run["gpu_memory_gib"]})
        if plan["exit_code"] == 1:
            raise SystemExit(f"{a.measured} line {i + 1}: the planner rejects this layout: {plan['errors']}")
        measured = {k: v["measured_gib"] for k, v in run["phases"].items()}
        emit({"tool": "check_memory_estimate", "predict_only": True, "measured_from": f"{a.measured}:{i + 1}",
              "device": run["device"], "world_size": run["world_size"], "layout": lay,
              "phases": phase_report(plan["phases"], measured)})
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.predict_only:
        return predict_only(a)
    device = "cpu" if a.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("check_memory_estimate: no CUDA device (use --cpu_smoke for the CPU code path)", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from megaforge.build import RunBuilder
    from megaforge.planner import make_plan
    from megaforge.trainer.megatron import MegatronTrainer

    cfg = build_config(a, device)
    progress(f"building the megatron trainer ({a.model_config}, tp={a.tp} pp={a.pp} cp={a.cp})")
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())  # joins torchrun's group (or a one-process one)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device == "cuda":
        gpu, mem_gib = device_name(tr.device), torch.cuda.get_device_properties(tr.device).total_memory / 2**30
    else:
        gpu, mem_gib = "cpu", 80.0
    plan = make_plan(RunBuilder(cfg).plan_input(), "grpo", {"nodes": 1, "gpus_per_node": world, "gpu": gpu, "gpu_memory_gib": mem_gib})
    if plan["exit_code"] == 1:
        raise SystemExit(f"the planner rejects this layout: {plan['errors']}")
    phases = plan["phases"]
    vocab = plan["model"]["vocab"]
    batch = full_length_batch(cfg, vocab)
    if a.beta > 0:
        tr.snapshot_reference()

    def train_phase():
        if a.beta > 0:
            batch.ref_logprobs = tr.compute_logprobs(batch, "ref", positions="trained")  # as the loop does
        return tr.train_step(batch)

    progress("warm-up train step")
    train_phase()  # warm-up: Adam moments allocated
    measured = {}
    if not a.no_rollout:
        if a.offload != "none":
            tr.offload()
        progress(f"rollout phase: {a.prompts} x {a.n_samples} sequences of {a.new_tokens} new tokens")
        with PeakMemory(tr.device, across_ranks=True) as pk:
            engine = None
            if rank == 0:
                from megaforge.rollout.embedded import EmbeddedEngine

                engine = EmbeddedEngine.from_spec(RunBuilder(cfg).engine_spec(), None, device=str(tr.device))
                comps = engine.generate(rollout_requests(cfg, vocab))
                assert all(len(c.output_ids) == cfg.rollout.max_new_tokens for c in comps)
                engine.release_memory(["weights", "kv_cache"])
                del engine, comps
        measured["rollout"] = pk.gib
        if a.offload != "none":
            tr.onload()
        if device == "cuda":
            torch.cuda.empty_cache()
    progress("train phase")
    with PeakMemory(tr.device, across_ranks=True) as pk:
        metrics = train_phase()
    measured["train"] = pk.gib
    out = {"tool": "check_memory_estimate", "device": gpu, "gpu_memory_gib": round(mem_gib, 2), "world_size": world,
           "model_config": a.model_config, "params": plan["model"]["hf_params"], "dtype": a.dtype,
           "layout": {"tp": a.tp, "pp": a.pp, "cp": a.cp, "sp": a.sp, "layer_spec": tr.spec, "recompute": a.recompute,
                      "micro_batch_size": a.micro_batch_size, "offload": a.offload, "beta": a.beta,
                      "lora": dataclasses.asdict(cfg.model.lora) if cfg.model.lora else None},
           "sequences": len(batch.lengths), "seq_len": int(batch.lengths[0]), "train_loss": metrics.get("loss")}
    out["phases"] = phase_report(phases, measured)
    # the same policy colocated with SGLang instead of the embedded engine: the planner's verdict per phase
    sgl = make_plan(RunBuilder(build_config(a, device, "sglang")).plan_input(), "grpo",
                    {"nodes": 1, "gpus_per_node": world, "gpu": gpu, "gpu_memory_gib": mem_gib})
    out["sglang_colocated_plan"] = {k: {"total_gib": v["total_gib"], "verdict": v["verdict"]} for k, v in sgl["phases"].items()}
    if rank == 0:
        emit(out, tr.device)
    tr.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
