"""Throughput of megaforge's Megatron RL train step beside a raw megatron-core pretraining step.

    torchrun --nproc_per_node 1 tools/bench/bench_train.py --shape 8l --layer_spec te [--fp8 hybrid]
    torchrun --nproc_per_node 1 tools/bench/bench_train.py --shape 24l --layer_spec torch
    torchrun --nproc_per_node 1 tools/bench/bench_train.py --shape moe4l --layer_spec te --moe_experts sequential,grouped
    python tools/bench/bench_train.py --tiny            # CPU smoke run of the same code path

Both steps run on the *same* model, optimizer and layout (one MegatronTrainer, random init):

* raw: megatron-core's own pretraining step: ``get_forward_backward_func`` over ``--micro_batches``
  micro-batches of ``--mbs`` full rows of ``seq`` tokens (sbhd, causal, megatron's vocab-parallel
  cross entropy), then the optimizer step;
* ours: ``MegatronTrainer.train_step`` on an RL TrainBatch: rows of mixed lengths paired so that
  every micro-batch packs exactly ``mbs * seq`` real tokens (thd, document masks), policy-gradient
  objective with entropy, metrics, gradient clipping, optimizer step.

TFLOP/s per GPU = (6 P n + 6 L h sum_d len_d^2) / time / GPUs, forward + backward, with P all
parameters, n the real tokens of the step and the attention term summed over documents d (a full
row of ``seq`` tokens gives the usual 6 L s h n; tools/bench/raw_megatron.py); a mixture of experts counts
the parameters a token is routed through (k of E experts). Prints one JSON line (rank 0). A step that runs out of
device memory on one GPU (raw megatron-core's fp32 logits at 16,384 tokens a micro-batch and 1.7B on 80 GB) is
reported as ``raw_error`` / ``ours_error`` with its figures and the ratio null; the other step is still measured.

Mixture of experts (``moe*`` shapes: Qwen3-30B-A3B's layer, 128 experts top-8, expert FFN 768, hidden
2048, 32 query / 4 key-value heads of 128, in fewer layers): ``--moe_experts sequential,grouped``
builds the model once per expert implementation (megatron's SequentialMLP, a GEMM per expert; TE's
grouped GEMM, TEGroupedMLP) in the same process and reports each beside its raw step, under
``variants``; the top-level figures are the last variant's.

LoRA (``--lora_rank R``; both steps then on the torch layer spec): after the full fine-tune's steps, the same
model is built again with rank-R adapters on the seven projections (``model.lora``, alpha ``--lora_alpha``,
default 2R) and only its RL step is timed on the same batch: ``lora_step_s``, ``lora_trainable_params``,
``lora_over_full`` (its step time over the full fine-tune's, in the same process), ``lora_peak_mem_gib``;
profiled / traced as ``ours_lora`` when asked.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Optional

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import PeakMemory, Stopwatch, device_name, emit, model_config, rl_batch, sync, time_per_call  # noqa: E402
from raw_megatron import flops, n_params, raw_microbatches, raw_step  # noqa: E402

SHAPES = {  # Llama layouts: layers, hidden, ffn, heads, kv heads, seq (tokens a row), vocab, mbs (full rows a micro-batch)
    "8l": dict(layers=8, hidden=4096, ffn=14336, heads=32, kv=8, seq=4096, vocab=32000, mbs=1),
    "24l": dict(layers=24, hidden=2048, ffn=5632, heads=16, kv=4, seq=4096, vocab=32000, mbs=2),
    # the recipes' models (configs/models/: qkv bias, QK norm, tied embeddings as the real ones), rows packed to 4,096
    "q05b": dict(model="qwen2.5-coder-0.5b", seq=4096, mbs=1),  # configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml's
    "q17b": dict(model="qwen3-1.7b", seq=4096, mbs=1),  # tools/bench/bench_grpo_step.py's
    "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, kv=2, seq=64, vocab=256, mbs=2),
    # Qwen3-30B-A3B's per-layer structure in 4 layers (3.0 B parameters, 0.9 B active a token)
    "moe4l": dict(layers=4, hidden=2048, ffn=6144, heads=32, kv=4, seq=4096, vocab=32000, mbs=1, head_dim=128,
                  experts=128, topk=8, expert_ffn=768),
    "tinymoe": dict(layers=2, hidden=64, ffn=128, heads=4, kv=2, seq=64, vocab=256, mbs=2, head_dim=16,
                    experts=4, topk=2, expert_ffn=32),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8l", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny shape, float32 (CPU smoke run; --shape tinymoe kept)")
    p.add_argument("--moe_experts", default="auto",
                   help="MoE shapes: trainer.moe_experts values to run one after another, comma-separated "
                        "(e.g. sequential,grouped)")
    p.add_argument("--layer_spec", default="auto", choices=["auto", "te", "torch"])
    p.add_argument("--fp8", default=None, choices=["hybrid", "e4m3"])
    p.add_argument("--fp8_recipe", default="delayed")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--micro_batches", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--mbs", type=int, default=None,
                   help="full rows of seq tokens a micro-batch (default: the shape's): raw's rows, ours packs as many "
                        "tokens in 2 x mbs rows; e.g. --shape q05b --mbs 4 --micro_batches 2 is the GSM8K recipe's "
                        "16,384-token micro-batch over the same 32,768 tokens a step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--fused_logprobs", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile one step of each (torch.profiler, python stacks): in DIR per step its kernel "
                        "table, its host waits and its host time by phase and by op and stack (<step>_host_ops.txt); "
                        "a JSON line on stderr with each step's GPU-busy share and its largest kernels")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also trace one step of each with little profiler overhead (no stacks): chrome traces "
                        "DIR/{raw,ours}_trace.json.gz and, on stderr, a JSON line per step with the GPU's idle "
                        "time charged to the host work that ran meanwhile (tools/bench/trace_gaps.py)")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="also time the RL step with rank-R adapters on the seven projections (0: not)")
    p.add_argument("--lora_alpha", type=float, default=None, help="the adapters' alpha (default 2 x rank)")
    a = p.parse_args(argv)
    if a.lora_rank < 0:
        p.error(f"--lora_rank {a.lora_rank}: a rank is >= 1 (0: no LoRA step)")
    if a.lora_rank and a.layer_spec == "te":
        p.error("--lora_rank needs --layer_spec torch (or auto): megatron's LoRA adapters wrap the torch spec's linears")
    if a.lora_rank:  # auto would pick TE for the full fine-tune where it is installed: both steps on one spec
        a.layer_spec = "torch"
    if a.tiny:
        a.shape = "tinymoe" if a.shape == "tinymoe" else "tiny"
        a.dtype, a.warmup, a.steps, a.micro_batches = "float32", 1, 2, 2
    return a


def hf_shape(shape: dict):
    """The transformers config of a SHAPES entry (untied embedding, rope theta 5e5): LlamaConfig, or
    Qwen3MoeConfig (every layer sparse, top-k renormalised) for an entry with ``experts``; an entry with
    ``model`` is that configs/models/ config as it is (its vocab and layers fill the entry's blanks)."""
    if shape.get("model"):
        hf = model_config(shape["model"])
        shape.setdefault("vocab", hf.vocab_size)
        return hf
    fields = {
        "model_type": "llama", "vocab_size": shape["vocab"], "hidden_size": shape["hidden"],
        "intermediate_size": shape["ffn"], "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv"], "max_position_embeddings": shape["seq"], "tie_word_embeddings": False,
        "rope_theta": 500000.0}
    if shape.get("experts"):
        fields.update(model_type="qwen3_moe", head_dim=shape["head_dim"], num_experts=shape["experts"],
                      num_experts_per_tok=shape["topk"], moe_intermediate_size=shape["expert_ffn"], norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6)
    return model_config(fields)


def paired_batch(shape: dict, n_micro: int, seed: int = 0):
    """Rows of mixed lengths, ``mbs * 2`` rows per micro-batch summing to ``mbs * seq`` tokens (the
    loss on each row's last three quarters): (TrainBatch, rows per micro-batch)."""
    g = torch.Generator().manual_seed(seed)
    s, rows_per_mb = shape["seq"], 2 * shape["mbs"]
    lengths = []
    for _ in range(n_micro * shape["mbs"]):
        a = int(torch.randint(s // 8, s - s // 8, (1,), generator=g))
        lengths += [a, s - a]
    lengths = torch.tensor(lengths)
    assert len(lengths) == n_micro * rows_per_mb
    return rl_batch(lengths, shape["vocab"], lengths // 4, width=s, generator=g), rows_per_mb


def _user_frames(event) -> list:
    """A profiler event's python stack outside torch, its module frames dropped (every layer's calls together)."""
    return [fr for fr in (event.stack or []) if not fr.startswith(("torch/", "contextlib.py", "<built-in", "nn.Module: "))
            and "site-packages/torch/" not in fr and "cpu_compat.py" not in fr]


def host_waits(prof, min_us: float = 50.0) -> list:
    """Where the host waited for the device: copies to the host, ``.item()`` and stream syncs taking
    over ``min_us`` each, grouped by (op, the python stack outside torch), most total time first."""
    acc: dict = {}
    for e in prof.events():
        if e.name not in ("aten::_local_scalar_dense", "aten::copy_", "cudaStreamSynchronize", "cudaMemcpyAsync"):
            continue
        if e.cpu_time_total < min_us:
            continue
        node, stack = e, []
        while node is not None and not stack:
            stack = _user_frames(node)
            node = node.cpu_parent
        key = (e.name, tuple(stack[:6]))
        n, us = acc.get(key, (0, 0.0))
        acc[key] = (n + 1, us + e.cpu_time_total)
    return sorted(acc.items(), key=lambda kv: -kv[1][1])


def host_ops(prof) -> tuple[dict, list]:
    """The step's host time by outermost aten operator (an op's nested aten calls are its own time),
    grouped by (phase, op, the python stack outside torch); phase: the innermost ``record_function``
    range around the op (``megaforge.forward``, ``raw.forward``, ``megaforge.loss``, ...), ``(backward)``
    for ops of autograd's thread (no python stack there), else ``(none)``. Returns ({phase: (calls, cpu
    us)}, [((phase, op, stack), (calls, cpu us))] most CPU time first). Where the GPU idles with no sync,
    this names the calls whose host time the device waited for (tools/bench/trace_gaps.py says in
    which phase)."""
    def is_range(e):
        return getattr(e, "is_user_annotation", False) or e.name.startswith(("megaforge.", "raw."))

    main = {e.thread for e in prof.events() if is_range(e)}
    acc: dict = {}
    phases: dict = {}
    for e in prof.events():
        if not e.name.startswith("aten::") or (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            continue
        node = e.cpu_parent
        while node is not None and not is_range(node):
            node = node.cpu_parent
        phase = node.name if node is not None else ("(backward)" if main and e.thread not in main else "(none)")
        stack = _user_frames(e)
        for d, key in ((acc, (phase, e.name, tuple(stack[:6]))), (phases, phase)):
            n, us = d.get(key, (0, 0.0))
            d[key] = (n + 1, us + e.cpu_time_total)
    return phases, sorted(acc.items(), key=lambda kv: -kv[1][1])


def _profiled(steps: dict, device, **profile_kw):
    """One step of each of ``steps`` (name -> fn) under torch.profiler (CPU, and CUDA where there);
    yields (name, profiler, wall seconds) on rank 0."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, fn in steps.items():
        sync(device)
        with profile(activities=acts, **profile_kw) as prof:
            with Stopwatch(device) as w:
                fn()
        if dist.get_rank() == 0:
            yield name, prof, w.seconds


def profile_steps(out_dir: str, steps: dict, device, top: int = 12) -> None:
    """One profiled step of each: kernel tables (by device time) in ``out_dir`` and, on stderr, one
    JSON line per step: wall seconds, summed kernel seconds, their ratio (GPU busy share, < 1 when
    the host makes the GPU wait), the ``top`` kernels' seconds and the ``top`` host operations by
    their own CPU seconds (a device sync shows as a long aten::item / cudaStreamSynchronize)."""
    os.makedirs(out_dir, exist_ok=True)
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # python stacks on the ops
    for name, prof, wall in _profiled(steps, device, with_stack=True, experimental_config=verbose):
        attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        avg = prof.key_averages()
        # kernels only: a record_function range (megaforge.forward, ...) also has a CUDA-side event
        # spanning its kernels, which would count them twice
        ev = [e for e in avg if device.type != "cuda" or (e.device_type.name == "CUDA" and not e.key.startswith("megaforge."))]
        ev.sort(key=lambda e: -getattr(e, attr))
        busy = sum(getattr(e, attr) for e in ev) / 1e6
        host = sorted(avg, key=lambda e: -e.self_cpu_time_total)  # syncs show here
        with open(os.path.join(out_dir, f"{name}_kernels.txt"), "w") as f:
            f.write(avg.table(sort_by=attr, row_limit=60, max_name_column_width=90))
        waits = host_waits(prof)
        with open(os.path.join(out_dir, f"{name}_host_waits.txt"), "w") as f:
            for (key, stack), (n, us) in waits[:20]:
                f.write(f"{key}  calls {n}  cpu {us / 1e3:.1f} ms\n" + "".join(f"    {fr}\n" for fr in stack) + "\n")
        phases, ops = host_ops(prof)
        with open(os.path.join(out_dir, f"{name}_host_ops.txt"), "w") as f:
            f.write("host CPU time by phase (outermost aten ops):\n" + "".join(
                f"  {ph}: {us / 1e3:.1f} ms in {n} calls\n" for ph, (n, us) in sorted(phases.items(), key=lambda kv: -kv[1][1])))
            for (phase, key, stack), (n, us) in ops[:60]:
                f.write(f"\n[{phase}] {key}  calls {n}  cpu {us / 1e3:.2f} ms\n" + "".join(f"    {fr}\n" for fr in stack))
        emit({"profile": name, "wall_s": round(wall, 4), "kernel_s": round(busy, 4), "busy_share": round(busy / wall, 3),
              "top": {e.key[:70]: round(getattr(e, attr) / 1e6, 4) for e in ev[:top]},
              "top_host": {e.key[:70]: round(e.self_cpu_time_total / 1e6, 4) for e in host[:top]},
              "host_waits": [[key, n, round(us / 1e6, 4), list(stack[:3])] for (key, stack), (n, us) in waits[:6]]},
             device, file=sys.stderr)


def trace_steps(out_dir: str, steps: dict, device) -> None:
    """One step of each under torch.profiler with CPU and CUDA activity but no stacks or shapes (a
    few microseconds per op), saved as a gzipped chrome trace; its idle-gap report on stderr."""
    import gzip

    from trace_gaps import gaps_report

    os.makedirs(out_dir, exist_ok=True)
    for name, prof, _ in _profiled(steps, device):
        raw = os.path.join(out_dir, f"{name}_trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f:
            text = f.read()
        os.remove(raw)
        with gzip.open(raw + ".gz", "wb") as g:
            g.write(text)
        if device.type == "cuda":
            emit({"trace": name, **gaps_report(json.loads(text)["traceEvents"])}, device, file=sys.stderr)


def measure(args, shape: dict, hf, tr) -> dict:
    """raw megatron-core and megaforge's RL train step on trainer ``tr``: times, TFLOP/s per GPU, their
    ratio, the allocator's peak; profiles / traces when asked."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dev = tr.device
    n_micro = args.micro_batches
    dp = parallel_state.get_data_parallel_world_size()
    batch, _ = paired_batch(shape, n_micro * dp)
    s, b = shape["seq"], shape["mbs"]
    data = raw_microbatches(shape["vocab"], s, b, n_micro, dev)
    world = dist.get_world_size()
    steps = {"raw": lambda: raw_step(tr, s, b, data), "ours": lambda: tr.train_step(batch)}  # raw first
    step_flops = {"raw": flops(hf, [s] * (b * n_micro * dp)), "ours": flops(hf, batch.lengths.tolist())}
    seconds, errors, churn = {}, {}, {}
    with PeakMemory(dev) as peak:  # peak_mem_gib: the allocator's peak over both steps (model resident)
        for name, fn in steps.items():
            seconds[name], errors[name], churn[name] = _time_or_oom(fn, args, dev)
    tflops = {n: None if seconds[n] is None else step_flops[n] / seconds[n] / world / 1e12 for n in steps}
    timed = {"layer_spec": tr.spec, "tokens_per_step": int(batch.lengths.sum()),
             "ours_tflops_per_gpu": tflops["ours"], "raw_tflops_per_gpu": tflops["raw"],
             "ours_step_s": seconds["ours"], "raw_step_s": seconds["raw"],
             "ratio": None if None in tflops.values() else tflops["ours"] / tflops["raw"],
             "peak_mem_gib": peak.gib, "device": device_name(dev),
             "ours_allocator": churn["ours"], "raw_allocator": churn["raw"]}
    timed.update({f"{n}_error": e for n, e in errors.items() if e})
    if dist.get_rank() == 0:  # the figures before the profiled steps: a run stopped while profiling keeps them
        print(f"[bench_train] timed {json.dumps({'shape': args.shape, **timed})}", file=sys.stderr, flush=True)
    both = {n: fn for n, fn in steps.items() if seconds[n] is not None}
    if args.profile:
        profile_steps(args.profile, both, dev)
    if args.trace:
        trace_steps(args.trace, both, dev)
    return timed


def measure_lora(args, shape: dict, tr) -> dict:
    """The RL step alone on LoRA trainer ``tr``, on the batch :func:`measure` built (same shape, same seed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    batch, _ = paired_batch(shape, args.micro_batches * parallel_state.get_data_parallel_world_size())
    step = lambda: tr.train_step(batch)  # noqa: E731
    with PeakMemory(tr.device) as peak:
        seconds, error, churn = _time_or_oom(step, args, tr.device)
    out = {"lora_step_s": seconds, "lora_peak_mem_gib": peak.gib, "lora_allocator": churn,
           # trainable: this rank's adapters alone
           "lora_trainable_params": sum(p.numel() for p in tr.bm.model.parameters() if p.requires_grad)}
    if error:
        out["lora_error"] = error
    if dist.get_rank() == 0:
        print(f"[bench_train] timed lora {json.dumps(out)}", file=sys.stderr, flush=True)
    if seconds is not None and args.profile:
        profile_steps(args.profile, {"ours_lora": step}, tr.device)
    if seconds is not None and args.trace:
        trace_steps(args.trace, {"ours_lora": step}, tr.device)
    return out


#: torch.cuda.memory_stats counters of the allocator's device calls: cudaMalloc, cudaFree (which synchronises the
#: device), and retries (an allocation that failed, freed the cache with cudaFree and tried again)
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_counts(dev) -> Optional[dict]:
    """The CUDA caching allocator's :data:`ALLOCATOR_COUNTERS` now (None off CUDA)."""
    if dev.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(dev)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}


def allocator_churn(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """What the allocator did over a step's warm-up and timed calls: each counter's increase (``device_alloc``
    cudaMalloc calls, ``device_free`` cudaFree calls, ``alloc_retries``). A cudaFree synchronises the device:
    the GPU then idles while the host catches up, which a trace charges to whatever host op runs next. After
    the first warm-up call a steady step adds 0. None off CUDA."""
    if before is None or after is None:
        return None
    return {k.removeprefix("num_"): after[k] - before[k] for k in ALLOCATOR_COUNTERS}


def _time_or_oom(fn, args, dev) -> tuple[Optional[float], Optional[str], Optional[dict]]:
    """(seconds per call of ``fn``, None, :func:`allocator_churn` over the calls), or (None, the error's first line,
    churn) when the step runs out of device memory: a step that does not fit (e.g. raw megatron-core's fp32 copy of
    16,384 x 151,936 logits on an 80 GB card) is reported, and the other step still measured, on memory the failed one
    gave back. One rank only: with more, the error is raised (the other ranks would wait for this one in the step's
    collectives)."""
    import torch.distributed as dist

    before = allocator_counts(dev)
    try:
        seconds, error = time_per_call(fn, args.warmup, args.steps, dev), None
    except torch.OutOfMemoryError as e:
        if dist.get_world_size() > 1:  # the other ranks would wait in the step's collectives
            raise
        seconds, error = None, f"OutOfMemoryError: {str(e).splitlines()[0] if str(e) else 'out of memory'}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return seconds, error, allocator_churn(before, allocator_counts(dev))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from megaforge.build import RunBuilder
    from megaforge.config import config_from_dict
    from megaforge.trainer.megatron import MegatronTrainer

    shape = dict(SHAPES[args.shape])
    if args.mbs:
        shape["mbs"] = args.mbs
    hf = hf_shape(shape)
    tmp = tempfile.mkdtemp(prefix="megaforge-bench-")  # one per rank
    hf.save_pretrained(tmp)
    variants = {}
    runs = [(e, None) for e in args.moe_experts.split(",")]
    if args.lora_rank:  # last: its step beside the full fine-tune's just measured
        runs.append((runs[-1][0], {"rank": args.lora_rank, "alpha": args.lora_alpha or 2.0 * args.lora_rank}))
    out: dict = {}  # the last full fine-tune's figures (the LoRA step is added to them)
    for experts, lora in runs:
        cfg = config_from_dict({
            "model": {"config": tmp, "dtype": args.dtype, "lora": lora},
            "trainer": {"backend": "megatron", "tensor_parallel": args.tp, "pipeline_parallel": args.pp,
                        "sequence_parallel": args.sp, "layer_spec": args.layer_spec, "fp8": args.fp8,
                        "fp8_recipe": args.fp8_recipe, "recompute": args.recompute, "lr": 1e-6,
                        "micro_batch_size": 2 * shape["mbs"], "grad_clip": 1.0, "moe_experts": experts,
                        "fused_logprobs": {"auto": None, "on": True, "off": False}[args.fused_logprobs]},
            "max_steps": 0, "seed": 0,
        })
        tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
        if lora:
            lo = measure_lora(args, shape, tr)
            full = out["ours_step_s"]
            out.update(lora_rank=lora["rank"], lora_alpha=lora["alpha"], lora_layer_spec=tr.spec, **lo,
                       lora_over_full=None if None in (lo["lora_step_s"], full) else lo["lora_step_s"] / full)
        else:
            out = measure(args, shape, hf, tr)
            out["moe_experts"] = ("grouped" if tr.bm.grouped_experts else "sequential") if tr.desc.is_moe else None
            variants[experts] = out
        tr.close()
        del tr
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        line = {"shape": args.shape, "mbs": shape["mbs"], "micro_batches": args.micro_batches, "fp8": args.fp8,
                "dtype": args.dtype, "tp": args.tp, "pp": args.pp,
                "world_size": dist.get_world_size(), "params": n_params(hf, active=False), "active_params": n_params(hf),
                **out}
        if len(variants) > 1:
            line["variants"] = variants
        emit(line, torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
