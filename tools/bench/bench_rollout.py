#!/usr/bin/env python
"""Rollout throughput: the embedded engine's fast path against HF ``generate`` (dynamic cache).

Prints ONE JSON line on stdout (progress goes to stderr). For each model shape (random weights from a
config dict, nothing downloaded) and batch size: B prompts of ``--prompt`` random tokens, ``--new``
sampled tokens each (temperature 1, no top-k/top-p, no EOS: every row generates ``--new`` tokens),

    hf:   model.generate(do_sample=True, top_k=0, min_new_tokens=max_new_tokens), default DynamicCache;
          a short warm-up generate first (its time is ``warmup_s``), then the timed run
    fast: EmbeddedEngine(fast="on"): a first full run (graph captures included: ``warmup_s``),
          then the timed (warm) run
    fast_compiled: the same with the per-layer pieces compiled (fast_options compile="inductor";
          ``warmup_s`` includes the compilation; skipped by --no-compile)

tok/s = sampled tokens / wall time (``torch.cuda.synchronize()`` around each timed call); ``ratio`` =
fast / hf (``ratio_compiled``: fast_compiled / hf). Every variant runs under ``--cap`` seconds (HF:
``max_time``; fast: an abort timer), a variant that runs out of memory is skipped with a note, and
so is every variant not started within ``--budget`` seconds (batch 256 of every shape runs first).
Full mode adds, per shape: the fast path
at the largest batch with engine max_batch min(256, batch / 4) (continuous refill), eager steps
(graphs off), top-p 0.9, greedy and 8 samples per prompt (shared prefill) at batch 256, and the fast
path's logprobs against a teacher-forced HF forward of its own samples (smallest batch).

With ``--sglang``: megaforge's fast engine against a real SGLang server on the same GPU instead of
HF: the shape's random weights are saved with a tokenizer folder, ``python -m sglang.launch_server``
serves them with the command line and environment a run gives its SGLang engine (built by
megaforge.rollout.http.sglang, :func:`sglang_server_bench.server_launch`; its own environment: ``--sglang_env_sh`` /
``--sglang_python``, as ``rollout.engine_env`` / ``rollout.engine_python``), each batch is one batched ``/generate`` of the same prompts
(``input_ids``, temperature 1, ``ignore_eos``, logprobs returned, as megaforge's rollout asks):
a warm-up run, the prefix cache flushed, ``--repeats`` timed runs (default 3, the median reported, every
run's figure in ``tok_s_runs``); then the server's memory is released and the
fast engine runs the same requests: eager, compiled, and compiled with the matmul decode attention
(``ratio`` = fast / sglang, ``ratio_compiled``, ``ratio_compiled_matmul``; ``--no-compile`` keeps the
eager one only). Shapes default to qwen2-0.5b and
qwen3-1.7b (Qwen3-1.7B's shape, configs/models/qwen3-1.7b). Every shape is built with a 4,096-token
position table and no BOS/EOS token (pad 0).

    python tools/bench/bench_rollout.py                 # H200: 0.5B and 1.5B shapes, batch 64/256/1024
    python tools/bench/bench_rollout.py --quick         # batch 256 only, no extras
    python tools/bench/bench_rollout.py --tiny          # CPU: a tiny shape, exercises the code path
    python tools/bench/bench_rollout.py --sglang --sglang_env_sh /tmp/sgl/env.sh     # fast engine vs SGLang
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import Stopwatch, device_name, emit, model_config, random_model, stage_logger, timed_runs  # noqa: E402
from sglang_server_bench import backend_suffix, sglang_rows  # noqa: E402

QWEN2 = dict(model_type="qwen2", rope_theta=1e6, rms_norm_eps=1e-6)
SHAPES = {  # HF config fields, or a name under configs/models/
    "qwen2-0.5b": dict(QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": "qwen3-1.7b",
    "tiny": dict(QWEN2, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
NEVER_STOPS = dict(max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=0)
T0 = time.time()
say = stage_logger("bench_rollout")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def build_model(shape: str, dev, dtype):
    """Random weights of the shape (seed 0) on ``dev``; HF generate never stops at an EOS."""
    model = random_model(model_config(SHAPES[shape], **NEVER_STOPS), dtype, dev)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_run(model, prompts, new: int, cap: float) -> tuple[int, float]:
    """(sampled tokens, wall seconds) of one HF generate over ``prompts`` [B, P]."""
    with Stopwatch(prompts.device) as w, torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                             max_time=cap)
    return (out.shape[1] - prompts.shape[1]) * prompts.shape[0], w.seconds


def fast_run(eng, reqs, cap: float) -> tuple[int, float, list]:
    """(sampled tokens, wall seconds, completions) of one engine.generate, aborted after ``cap`` s."""
    timer = threading.Timer(cap, eng.abort)
    with Stopwatch(eng.device) as w:
        timer.start()
        try:
            comps = eng.generate(reqs)
        finally:
            timer.cancel()
    return sum(len(c.output_ids) for c in comps), w.seconds, comps


def requests(prompts, new: int, n_samples: int = 1, **sp):
    from megaforge.types import GenerateRequest, SamplingParams

    params = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new, stop_token_ids=[])
    params.update(sp)
    return [GenerateRequest(p, SamplingParams(**params), f"r{i}-{k}")
            for i, p in enumerate(prompts.tolist()) for k in range(n_samples)]


def variant(fn, dev) -> dict:
    """Run one measurement; an out-of-memory error becomes a note."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one failed variant must not lose the others' figures
        free(dev)
        if is_oom(e):
            say(f"  skipped (OOM): {str(e).splitlines()[0][:160]}")
            return {"skipped": "OOM: " + str(e).splitlines()[0][:200]}
        say(f"  failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def measure_hf(model, prompts, new, cap) -> dict:
    w_tok, w_wall = hf_run(model, prompts, min(16, new), cap)
    tok, wall = hf_run(model, prompts, new, cap)
    return {"tok_s": round(tok / wall, 1), "wall_s": round(wall, 3), "tokens": tok, "warmup_s": round(w_wall, 3),
            "warmup_tokens": w_tok, "capped": tok < prompts.shape[0] * new}


def measure_fast(model, reqs, max_batch, cap, dev, repeats: int = 1, **opts) -> dict:
    """A first run (graph captures, compilation), then ``repeats`` timed runs: the median by tok/s."""
    from megaforge.rollout.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model, None, max_batch=max_batch, fast="on", fast_options=opts)
    try:
        c_tok, c_wall, _ = fast_run(eng, reqs, cap)
        runs = []
        for _ in range(repeats):
            tok, wall, comps = fast_run(eng, reqs, cap)
            runs.append((tok, wall))  # comps: the last run's (logprob_check reads them)
        st = dict(eng.fast.stats)
        want = sum(r.sampling.max_new_tokens for r in reqs)
        return {**timed_runs(runs), "warmup_s": round(c_wall, 3), "warmup_tok_s": round(c_tok / c_wall, 1),
                "capped": min(t for t, _ in runs) < want,
                "graph_captures": st["graph_captures"], "graph_failures": st["graph_failures"],
                "cache_gib": round(st["cache_bytes"] / 2 ** 30, 2), "_comps": comps}
    finally:
        eng.release_memory(["kv_cache", "cuda_graph"])
        del eng
        free(dev)


def logprob_check(model, reqs, comps, rows: int = 8) -> dict:
    """Max / mean |fast logprob - teacher-forced HF logprob| over ``rows`` samples (temperature 1)."""
    diffs = []
    for r, c in list(zip(reqs, comps))[:rows]:
        seq = torch.tensor([r.input_ids + c.output_ids], device=model.device)
        with torch.no_grad():
            logits = model(seq).logits[0, len(r.input_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, seq[0, len(r.input_ids):, None]).squeeze(-1)
        diffs.append((ref - torch.tensor(c.output_logprobs, device=ref.device)).abs())
    d = torch.cat(diffs)
    return {"rows": len(diffs), "max_abs": round(d.max().item(), 5), "mean_abs": round(d.mean().item(), 6)}


def over_budget(args) -> bool:
    return time.time() - T0 > args.budget


def skipped_budget(args) -> dict:
    say("  skipped: time budget spent")
    return {"skipped": f"time budget (--budget {args.budget:.0f} s) spent"}


def batch_row(shape, model, B, args, dev) -> dict:
    """HF, fast and fast_compiled at batch B (same prompts), with their ratios."""
    V = model.config.vocab_size
    prompts = torch.randint(3, V, (B, args.prompt), generator=torch.Generator().manual_seed(B)).to(dev)
    reqs = requests(prompts, args.new)
    row = {}
    if over_budget(args):
        return skipped_budget(args)
    say(f"{shape} B={B}: HF generate (dynamic cache)")
    row["hf"] = variant(lambda: measure_hf(model, prompts, args.new, args.cap), dev)
    say(f"  hf: {row['hf'].get('tok_s')} tok/s")
    say(f"{shape} B={B}: fast path")
    row["fast"] = variant(lambda: measure_fast(model, reqs, B, args.cap, dev), dev)
    comps = row["fast"].pop("_comps", None)
    say(f"  fast: {row['fast'].get('tok_s')} tok/s (warm-up run {row['fast'].get('warmup_s')} s)")
    if comps is not None and B == min(args.batches) and not args.quick:
        row["fast_logprob_check"] = logprob_check(model, reqs, comps)
    del comps
    free(dev)
    if args.compile:
        say(f"{shape} B={B}: fast path, compiled ({args.compile})")
        row["fast_compiled"] = (skipped_budget(args) if over_budget(args) else
                                variant(lambda: measure_fast(model, reqs, B, args.cap, dev, compile=args.compile), dev))
        row["fast_compiled"].pop("_comps", None)
        say(f"  fast_compiled: {row['fast_compiled'].get('tok_s')} tok/s "
            f"(warm-up run {row['fast_compiled'].get('warmup_s')} s)")
    if "tok_s" in row["hf"] and "tok_s" in row["fast"]:
        row["ratio"] = round(row["fast"]["tok_s"] / row["hf"]["tok_s"], 2)
    if "tok_s" in row["hf"] and "tok_s" in row.get("fast_compiled", {}):
        row["ratio_compiled"] = round(row["fast_compiled"]["tok_s"] / row["hf"]["tok_s"], 2)
    free(dev)
    return row


def extra_rows(shape, model, args, dev) -> dict:
    """Refill, eager steps, top-p, greedy and shared-prefill runs of the fast path."""
    ex = {}
    V = model.config.vocab_size
    Bmax = max(args.batches)
    mid = 256 if 256 in args.batches else args.batches[0]
    g2 = torch.Generator().manual_seed(2)
    pm = torch.randint(3, V, (mid, args.prompt), generator=g2).to(dev)
    mb = max(1, min(256, Bmax // 4))
    runs = {
        f"refill_B{Bmax}_maxbatch{mb}": lambda: measure_fast(
            model, requests(torch.randint(3, V, (Bmax, args.prompt), generator=g2).to(dev), args.new),
            mb, args.cap, dev),
        f"top_p0.9_B{mid}": lambda: measure_fast(model, requests(pm, args.new, top_p=0.9), mid, args.cap, dev),
        f"greedy_B{mid}": lambda: measure_fast(model, requests(pm, args.new, temperature=0.0), mid, args.cap, dev),
        f"n8_shared_prefill_B{mid}": lambda: measure_fast(
            model, requests(pm[: max(1, mid // 8)], args.new, n_samples=8), mid, args.cap, dev),
    }
    if dev.type == "cuda":
        runs[f"eager_steps_B{mid}"] = lambda: measure_fast(model, requests(pm, args.new), mid, args.cap, dev,
                                                           graphs=False)
    for name, fn in runs.items():
        say(f"{shape}: extra {name}")
        ex[name] = skipped_budget(args) if over_budget(args) else variant(fn, dev)
        ex[name].pop("_comps", None)
        say(f"  {name}: {ex[name].get('tok_s')} tok/s")
    return ex


# ------------------------------------------------------------------------------------- vs SGLang
def fast_variants(args) -> list[tuple[str, dict]]:
    """The fast engine's variants against SGLang: (name, FastDecoder options); ratio keys follow the
    names (fast -> ratio, fast_compiled -> ratio_compiled, ...)."""
    out = [("fast", {"attention": "sdpa"})]
    if args.compile:
        out += [("fast_compiled", {"compile": args.compile, "attention": "sdpa"}),
                ("fast_compiled_matmul", {"compile": args.compile, "attention": "matmul"})]
    if not args.variants:
        return out
    out.append(("fast_default", {"compile": args.compile, "attention": "auto"}))  # what rollout.fast_* auto gives
    want = args.variants.split(",")
    unknown = sorted(set(want) - {n for n, _ in out})
    if unknown:
        raise SystemExit(f"--variants: {unknown} not among {[n for n, _ in out]} (compile off drops the compiled ones)")
    return [(n, o) for n, o in out if n in want]


def versus_sglang(shape: str, model, args, dev, tmp: str) -> dict:
    """Fast engine vs SGLang at every batch size: SGLang first (fast engine's model idle on the GPU),
    then its memory released and the fast engine on the same requests (:func:`sglang_server_bench.sglang_rows`,
    :func:`fast_rows`), with the ratios ``ratio<variant>[_<backend>]`` = fast variant / that SGLang."""
    out = sglang_rows(shape, model, args, dev, tmp,
                      fast_rows=lambda prompts, rows: fast_rows(model, prompts, rows, args, dev, shape),
                      guard=lambda fn: variant(fn, dev), say=say)
    backends = args.sglang_attention or [None]
    for B in args.batches:  # ratio<variant>[_<backend>] = fast variant / that SGLang
        r = out["batches"][str(B)]
        for name, _ in fast_variants(args):
            for sfx in map(backend_suffix, backends):
                if "tok_s" in r.get(name, {}) and "tok_s" in r.get("sglang" + sfx, {}):
                    r["ratio" + name[4:] + sfx] = round(r[name]["tok_s"] / r["sglang" + sfx]["tok_s"], 3)
    return out


def fast_rows(model, prompts: dict, rows: dict, args, dev, shape: str) -> None:
    """The fast engine's variants on the same requests, at every batch size, into ``rows[B][variant]``."""
    for B in args.batches:
        for name, opts in fast_variants(args):
            say(f"{shape} B={B}: {name} {opts}")
            row = variant(lambda: measure_fast(model, requests(prompts[B], args.new), B, args.cap, dev,
                                               args.repeats, **opts), dev)
            row.pop("_comps", None)
            rows[str(B)][name] = row
            say(f"  {name}: {row.get('tok_s')} tok/s")


def parse_args(argv=None):
    """(args, shapes, device, dtype) of the command line, the defaults filled in (``args.dtype_name``
    the dtype's name, ``args.batches`` a list, ``args.compile`` the backend or None)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 256 only (tiny: 8), no extras")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (runs on CPU)")
    ap.add_argument("--shapes", default=None, help="comma-separated, default qwen2-0.5b,qwen2-1.5b")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes, default 64,256,1024")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; tiny 16)")
    ap.add_argument("--new", type=int, default=None, help="sampled tokens (default 256; tiny 32)")
    ap.add_argument("--cap", type=float, default=45.0, help="seconds per measured run")
    ap.add_argument("--budget", type=float, default=360.0,
                    help="seconds for the whole run: variants not started by then are skipped with a note")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (tiny on CPU: float32)")
    ap.add_argument("--compile", default=None, help="torch.compile backend of the fast_compiled rows "
                    "(default: inductor on CUDA, none on CPU)")
    ap.add_argument("--no-compile", action="store_true", help="no fast_compiled rows")
    ap.add_argument("--sglang", action="store_true", help="the fast engine against an SGLang server (not HF)")
    ap.add_argument("--sglang_server", default="sglang", choices=["sglang", "embedded"],
                    help="embedded: megaforge's server stands in (CPU check of the code path)")
    ap.add_argument("--sglang_env_sh", default=os.environ.get("MEGAFORGE_SGLANG_ENV_SH", ""),
                    help="a shell file setting the server's environment (the GPU kit's /tmp/sgl/env.sh)")
    ap.add_argument("--sglang_python", default=os.environ.get("MEGAFORGE_SGLANG_PYTHON", ""))
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed runs per variant and batch after the warm-up, the median reported "
                         "(default 3 with --sglang: SGLang's single-run figure moves by up to 25%% between runs; else 1)")
    ap.add_argument("--sglang_mem", type=float, default=0.5, help="--mem-fraction-static of the server")
    ap.add_argument("--sglang_args", default="--attention-backend triton --sampling-backend pytorch "
                    "--cuda-graph-backend-prefill disabled", help="more server flags (the ones that work on the H200 kit)")
    ap.add_argument("--sglang_attention", default=None,
                    help="with --sglang: comma-separated SGLang attention backends (e.g. fa3,triton), one server each "
                         "on the same requests in this run (rows sglang_<backend>, ratios ratio<variant>_<backend>); "
                         "default: the one --sglang_args names (rows sglang, ratio<variant>)")
    ap.add_argument("--variants", default=None,
                    help="with --sglang: comma-separated fast-engine variants to run (fast, fast_compiled, "
                         "fast_compiled_matmul, or fast_default: rollout.fast_compile / fast_attention auto, what "
                         "a user gets; default the first three)")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.sglang else 1)
    if args.sglang_attention is not None:
        if not args.sglang or args.sglang_server != "sglang":
            ap.error("--sglang_attention needs --sglang with the real SGLang server (--sglang_server sglang)")
        args.sglang_attention = [a for a in args.sglang_attention.split(",") if a]
        if not args.sglang_attention or len(set(args.sglang_attention)) != len(args.sglang_attention):
            ap.error(f"--sglang_attention: distinct backend names wanted, got {args.sglang_attention!r}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    dev = torch.device(args.device)
    args.compile = None if args.no_compile else (args.compile or ("inductor" if dev.type == "cuda" else None))
    if args.tiny:
        shapes = ["tiny"]
        args.batches = [int(b) for b in (args.batches or ("8" if args.quick else "4,8,16")).split(",")]
        args.prompt, args.new = args.prompt or 16, args.new or 32
    else:
        shapes = (args.shapes or ("qwen2-0.5b,qwen3-1.7b" if args.sglang else "qwen2-0.5b,qwen2-1.5b")).split(",")
        args.batches = [int(b) for b in (args.batches or ("256" if args.quick else "64,256,1024")).split(",")]
        args.prompt, args.new = args.prompt or 128, args.new or 256
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[
        args.dtype or ("float32" if dev.type == "cpu" else "bfloat16")]
    args.dtype_name = str(dtype).split(".")[-1]
    return args, shapes, dev, dtype


def main(argv=None) -> int:
    args, shapes, dev, dtype = parse_args(argv)
    if dev.type == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    import transformers

    if args.sglang:
        return main_sglang(shapes, args, dev, dtype)

    out = {"bench": "rollout", "device": device_name(dev),
           "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype).split(".")[-1],
           "prompt_tokens": args.prompt, "sampled_tokens": args.new, "cap_s": args.cap, "budget_s": args.budget,
           "shapes": {}}
    models = {}
    for shape in shapes:
        say(f"{shape}: building random {dtype} model on {dev}")
        models[shape] = build_model(shape, dev, dtype)
        n_params = sum(p.numel() for p in models[shape].parameters())
        out["shapes"][shape] = {"params_m": round(n_params / 1e6, 1), "batches": {}}
    # batch 256 (the target) of every shape first, then the other batches, then the extras
    for B in sorted(args.batches, key=lambda b: (b != 256, args.batches.index(b))):
        for shape in shapes:
            out["shapes"][shape]["batches"][str(B)] = batch_row(shape, models[shape], B, args, dev)
    if not args.quick:
        for shape in shapes:
            out["shapes"][shape]["extras"] = extra_rows(shape, models[shape], args, dev)
    del models
    free(dev)
    target = {}
    for shape, r in out["shapes"].items():
        row = r["batches"].get("256")
        if row is not None and "ratio" in row:
            target[shape] = {"ratio_B256": row["ratio"], "met_3x": row["ratio"] >= 3.0,
                             "ratio_compiled_B256": row.get("ratio_compiled")}
    out["target_B256"] = target
    out["total_s"] = round(time.time() - T0, 1)
    emit(out, dev)
    return 0


def main_sglang(shapes, args, dev, dtype) -> int:
    import tempfile

    out = {"bench": "rollout_vs_sglang", "device": device_name(dev),
           "torch": torch.__version__, "dtype": args.dtype_name, "prompt_tokens": args.prompt, "sampled_tokens": args.new,
           "server": args.sglang_server, "server_args": args.sglang_args, "sglang_attention": args.sglang_attention,
           "repeats": args.repeats, "shapes": {}}
    tmp = tempfile.mkdtemp(prefix="bench-rollout-sglang-")
    for shape in shapes:
        say(f"{shape}: building random {dtype} model on {dev}")
        model = build_model(shape, dev, dtype)
        out["shapes"][shape] = {"params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
        try:
            out["shapes"][shape].update(versus_sglang(shape, model, args, dev, tmp))
        except Exception as e:  # noqa: BLE001  (the other shape's figures still count)
            out["shapes"][shape]["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            say(f"{shape} failed: {e}")
        del model
        free(dev)
    for name, _ in fast_variants(args):
        for sfx in map(backend_suffix, args.sglang_attention or [None]):
            out[f"{name}_not_slower{sfx}_at_B<=256"] = {
                shape: all(r.get("ratio" + name[4:] + sfx, 0) >= 1.0 for b, r in v.get("batches", {}).items() if int(b) <= 256)
                for shape, v in out["shapes"].items()}
    out["total_s"] = round(time.time() - T0, 1)
    emit(out, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
