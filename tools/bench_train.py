"""Throughput of megaforge's Megatron RL train step beside a raw megatron-core pretraining step.

    torchrun --nproc_per_node 1 tools/bench_train.py --shape 8l --layer_spec te [--fp8 hybrid]
    torchrun --nproc_per_node 1 tools/bench_train.py --shape 24l --layer_spec torch
    python tools/bench_train.py --tiny            # CPU smoke run of the same code path

Both steps run on the *same* model, optimizer and layout (one MegatronTrainer, random init):

* raw: megatron-core's own pretraining step: ``get_forward_backward_func`` over ``--micro_batches``
  micro-batches of ``--mbs`` full rows of ``seq`` tokens (sbhd, causal, megatron's vocab-parallel
  cross entropy), then the optimizer step;
* ours: ``MegatronTrainer.train_step`` on an RL TrainBatch: rows of mixed lengths paired so that
  every micro-batch packs exactly ``mbs * seq`` real tokens (thd, document masks), policy-gradient
  objective with entropy, metrics, gradient clipping, optimizer step.

TFLOP/s per GPU = (6 P n + 6 L h sum_d len_d^2) / time / GPUs, forward + backward, with P all
parameters, n the real tokens of the step and the attention term summed over documents d (a full
row of ``seq`` tokens gives the usual 6 L s h n). Prints one JSON line (rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # layers, hidden, ffn, heads, kv heads, seq, vocab, mbs
    "8l": dict(layers=8, hidden=4096, ffn=14336, heads=32, kv=8, seq=4096, vocab=32000, mbs=1),
    "24l": dict(layers=24, hidden=2048, ffn=5632, heads=16, kv=4, seq=4096, vocab=32000, mbs=2),
    "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, kv=2, seq=64, vocab=256, mbs=2),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8l", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny shape, float32 (CPU smoke run)")
    p.add_argument("--layer_spec", default="auto", choices=["auto", "te", "torch"])
    p.add_argument("--fp8", default=None, choices=["hybrid", "e4m3"])
    p.add_argument("--fp8_recipe", default="delayed")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--micro_batches", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--fused_logprobs", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile one step of each (torch.profiler): kernel tables in DIR, and a "
                        "JSON line on stderr with each step's GPU-busy share and its largest kernels")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also trace one step of each with little profiler overhead (no stacks): chrome traces "
                        "DIR/{raw,ours}_trace.json.gz and, on stderr, a JSON line per step with the GPU's idle "
                        "time charged to the host work that ran meanwhile (tools/trace_gaps.py)")
    a = p.parse_args(argv)
    if a.tiny:
        a.shape, a.dtype, a.warmup, a.steps, a.micro_batches = "tiny", "float32", 1, 2, 2
    return a


def write_hf_config(shape: dict, path: str) -> str:
    import transformers

    transformers.LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        max_position_embeddings=shape["seq"], tie_word_embeddings=False, rope_theta=500000.0,
    ).save_pretrained(path)
    return path


def rl_batch(shape: dict, n_micro: int, seed: int = 0):
    """Rows of mixed lengths, ``mbs * 2`` rows per micro-batch summing to ``mbs * seq`` tokens."""
    from megaforge.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    s, rows_per_mb = shape["seq"], 2 * shape["mbs"]
    lengths = []
    for _ in range(n_micro * shape["mbs"]):
        a = int(torch.randint(s // 8, s - s // 8, (1,), generator=g))
        lengths += [a, s - a]
    lengths = torch.tensor(lengths)
    B = len(lengths)
    assert B == n_micro * rows_per_mb
    t = torch.arange(s)[None]
    valid = t < lengths[:, None]
    tokens = torch.randint(0, shape["vocab"], (B, s), generator=g) * valid
    mask = (valid & (t >= lengths[:, None] // 4)).float()
    adv = torch.randn(B, 1, generator=g).expand(B, s) * mask
    roll = (-2.0 + 0.1 * torch.randn(B, s, generator=g)) * mask
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=adv.contiguous(),
                      rollout_logprobs=roll, num_tokens=int(mask.sum()), num_seqs=B), rows_per_mb


def n_params(shape: dict) -> int:
    h, f, L, V = shape["hidden"], shape["ffn"], shape["layers"], shape["vocab"]
    hd = h // shape["heads"]
    attn = h * hd * (shape["heads"] + 2 * shape["kv"]) + shape["heads"] * hd * h
    return L * (attn + 3 * h * f + 2 * h) + 2 * V * h + h


def flops(shape: dict, doc_lengths) -> float:
    n = sum(doc_lengths)
    return 6.0 * n_params(shape) * n + 6.0 * shape["layers"] * shape["hidden"] * sum(x * x for x in doc_lengths)


def raw_step(tr, shape: dict, n_micro: int, data):
    """megatron-core's pretraining step on tr's model and optimizer."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(it, model):
        tokens, pos, labels = next(it)
        per_token = model(tokens, pos, None, labels=labels)  # [b, s] cross entropy

        def loss_func(x):
            loss = x.float().sum()
            return loss, torch.tensor(x.numel(), device=x.device, dtype=torch.int), {"lm loss": loss.detach()}
        return per_token, loss_func

    tr.ddp.train()
    tr.ddp.zero_grad_buffer()
    tr.optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(data), model=[tr.ddp], num_microbatches=n_micro,
        seq_length=shape["seq"], micro_batch_size=shape["mbs"], forward_only=False)
    tr.optimizer.step()


def timed(fn, warmup: int, steps: int, device) -> float:
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    dt = torch.tensor([(time.perf_counter() - t0) / steps], device=device)  # NCCL reduces device tensors
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


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
            stack = [fr for fr in (node.stack or []) if not fr.startswith(("torch/", "contextlib.py", "<built-in"))
                     and "site-packages/torch/" not in fr and "cpu_compat.py" not in fr]
            node = node.cpu_parent
        key = (e.name, tuple(stack[:6]))
        n, us = acc.get(key, (0, 0.0))
        acc[key] = (n + 1, us + e.cpu_time_total)
    return sorted(acc.items(), key=lambda kv: -kv[1][1])


def _profiled(steps: dict, device, **profile_kw):
    """One step of each of ``steps`` (name -> fn) under torch.profiler (CPU, and CUDA where there);
    yields (name, profiler, wall seconds) on rank 0."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name, fn in steps.items():
        sync()
        with profile(activities=acts, **profile_kw) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall = time.perf_counter() - t0
        if dist.get_rank() == 0:
            yield name, prof, wall


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
        ev = [e for e in avg if device.type != "cuda" or e.device_type.name == "CUDA"]
        ev.sort(key=lambda e: -getattr(e, attr))
        busy = sum(getattr(e, attr) for e in ev) / 1e6
        host = sorted(avg, key=lambda e: -e.self_cpu_time_total)  # syncs show here
        with open(os.path.join(out_dir, f"{name}_kernels.txt"), "w") as f:
            f.write(avg.table(sort_by=attr, row_limit=60, max_name_column_width=90))
        waits = host_waits(prof)
        with open(os.path.join(out_dir, f"{name}_host_waits.txt"), "w") as f:
            for (key, stack), (n, us) in waits[:20]:
                f.write(f"{key}  calls {n}  cpu {us / 1e3:.1f} ms\n" + "".join(f"    {fr}\n" for fr in stack) + "\n")
        print(json.dumps({"profile": name, "wall_s": round(wall, 4), "kernel_s": round(busy, 4),
                          "busy_share": round(busy / wall, 3),
                          "top": {e.key[:70]: round(getattr(e, attr) / 1e6, 4) for e in ev[:top]},
                          "top_host": {e.key[:70]: round(e.self_cpu_time_total / 1e6, 4) for e in host[:top]},
                          "host_waits": [[key, n, round(us / 1e6, 4), list(stack[:3])] for (key, stack), (n, us) in waits[:6]]}),
              file=sys.stderr, flush=True)


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
            print(json.dumps({"trace": name, **gaps_report(json.loads(text)["traceEvents"])}), file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from megaforge.config import config_from_dict
    from megaforge.trainer.megatron import MegatronTrainer

    shape = SHAPES[args.shape]
    tmp = write_hf_config(shape, tempfile.mkdtemp(prefix="megaforge-bench-"))  # one per rank
    cfg = config_from_dict({
        "model": {"config": tmp, "dtype": args.dtype},
        "trainer": {"backend": "megatron", "tensor_parallel": args.tp, "pipeline_parallel": args.pp,
                    "sequence_parallel": args.sp, "layer_spec": args.layer_spec, "fp8": args.fp8,
                    "fp8_recipe": args.fp8_recipe, "recompute": args.recompute, "lr": 1e-6,
                    "micro_batch_size": 2 * shape["mbs"], "grad_clip": 1.0,
                    "fused_logprobs": {"auto": None, "on": True, "off": False}[args.fused_logprobs]},
        "max_steps": 0, "seed": 0,
    })
    tr = MegatronTrainer(cfg)
    dev = tr.device
    n_micro = args.micro_batches
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    batch, _ = rl_batch(shape, n_micro * dp)
    g = torch.Generator().manual_seed(1)
    s, b = shape["seq"], shape["mbs"]
    data = []
    for _ in range(n_micro):
        tok = torch.randint(0, shape["vocab"], (b, s + 1), generator=g)
        data.append((tok[:, :-1].to(dev), torch.arange(s, device=dev)[None].expand(b, s).contiguous(),
                     tok[:, 1:].to(dev)))
    world = dist.get_world_size()
    t_raw = timed(lambda: raw_step(tr, shape, n_micro, data), args.warmup, args.steps, dev)
    raw_flops = flops(shape, [s] * (b * n_micro * dp))
    t_ours = timed(lambda: tr.train_step(batch), args.warmup, args.steps, dev)
    ours_flops = flops(shape, batch.lengths.tolist())
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    both = {"raw": lambda: raw_step(tr, shape, n_micro, data), "ours": lambda: tr.train_step(batch)}
    if args.profile:
        profile_steps(args.profile, both, dev)
    if args.trace:
        trace_steps(args.trace, both, dev)
    if dist.get_rank() == 0:
        print(json.dumps({
            "shape": args.shape, "layer_spec": tr.spec, "fp8": args.fp8, "dtype": args.dtype, "tp": args.tp,
            "pp": args.pp, "world_size": world, "params": n_params(shape), "tokens_per_step": int(batch.lengths.sum()),
            "ours_tflops_per_gpu": ours_flops / t_ours / world / 1e12, "raw_tflops_per_gpu": raw_flops / t_raw / world / 1e12,
            "ours_step_s": t_ours, "raw_step_s": t_raw, "ratio": (ours_flops / t_ours) / (raw_flops / t_raw),
            "peak_mem_gib": mem, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        }), flush=True)
    tr.close()
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
