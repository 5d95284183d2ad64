#!/usr/bin/env python
"""Colocation on one GPU: trainer offload/onload, weight sync into the engine, and the colocated GRPO step.

Prints ONE JSON line on stdout (progress on stderr). The trainer (torch backend by default, HF
modules; ``--backend megatron``) runs in this process, megaforge's embedded engine server in another
process on the same GPU (``rollout.engine: embedded_server``, ``rollout.num_gpus: 0``), with random
weights of ``--model_config`` (default Qwen3-1.7B's shape, bf16; nothing downloaded), ``memory.offload:
pinned`` and ``sync.transport: ipc``, ``sync.bucket_mb: 512``. Phases (each skipped with a note when it
fails or when ``--budget`` seconds are spent):

1. steps: ``--steps`` colocated GRPO steps through :meth:`megaforge.loop.Run.rl_step` (``--prompts``
   x ``--samples`` sequences of ``--new_tokens`` sampled tokens; random weights never stop early).
   ``share`` = (time/offload + time/onload + time/sync) / time/step, mean over the steps after the
   first (the first pays CUDA-graph captures and the one-time pinned host allocation, reported apart).
2. offload: engine memory released, then ``--rounds`` x trainer ``onload()`` / ``offload()`` of all
   its state (weights, AdamW moments, reference); GiB/s = bytes moved / 2^30 / seconds (median round;
   copies finished: the call waits on the copy stream's event). Target >= 40 (pinned copy ceiling
   measured 51.4 D2H / 51.5 H2D).
3. sync: trainer weights onloaded, engine weights resumed, ``--rounds`` x ``push_weights`` over CUDA
   IPC; GB/s = bytes of HF tensors delivered and loaded (every bucket answered after the engine's
   device synchronised) / 1e9 / seconds of the whole update (session, pause/continue, version
   check included). Target >= 50.
4. tms: the same trainer state paused/resumed by torch_memory_saver (CPU backup); GiB/s of each.
   The first offload/onload migrates the tensors into its pool (reported as ``migration_s``).
5. nccl (``--nccl``, 2 GPUs): a second engine server on GPU 1, ``sync.transport: nccl``; GB/s as in
   3 (the group's set-up reported apart), and the device memory the weight-update communicator holds
   in this process (``outside_torch_gib`` before/after).

    python tools/bench/bench_colocate.py              # 1 H200: ~4-5 min
    python tools/bench/bench_colocate.py --nccl       # 2 H200: adds the nccl transport, ~5-6 min
    python tools/bench/bench_colocate.py --tiny       # CPU: tiny model, shm transport, CPU-emulated copy engine
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import GIB, MODELS, ROOT, Stopwatch, device_name, emit, model_config, stage_logger, write_random_model  # noqa: E402

T0 = time.time()
say = stage_logger("bench_colocate")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_config", default=os.path.join(MODELS, "qwen3-1.7b"))
    p.add_argument("--backend", default="torch", choices=["torch", "megatron"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=1024)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket_mb", type=int, default=512)
    p.add_argument("--nccl", action="store_true", help="also the nccl transport to an engine on a second GPU")
    p.add_argument("--no_tms", action="store_true")
    p.add_argument("--budget", type=float, default=330.0, help="seconds after which remaining phases are skipped")
    p.add_argument("--tiny", action="store_true", help="CPU: tiny model, the code paths only")
    a = p.parse_args(argv)
    if a.tiny:
        a.model_config = os.path.join(MODELS, "tiny-qwen2")
        a.prompts, a.samples, a.new_tokens, a.micro_batch_size, a.rounds = 2, 2, 8, 4, 2
    return a


def time_left(a) -> float:
    return a.budget - (time.time() - T0)


def build_config(a, out: str, model_dir: str, device: str, transport: str, run_name: str, num_gpus: int = 0):
    from megaforge.config import config_from_dict

    cpu = device == "cpu"
    trainer = {"backend": a.backend, "device": device, "lr": 1e-6, "micro_batch_size": a.micro_batch_size,
               "mini_batches": 1, "grad_clip": 1.0}
    if a.backend == "megatron":
        trainer.update(layer_spec="torch" if cpu else "auto", distributed_optimizer=True)
    return config_from_dict({
        "output_dir": out, "run_name": run_name, "max_steps": max(a.steps, 1), "seed": 0,
        "model": {"path": model_dir, "tokenizer": os.path.join(ROOT, "assets", "tiny-tokenizer"),
                  "dtype": "float32" if cpu else "bfloat16"},
        "data": {"path": "arithmetic", "format": "synthetic", "max_prompt_len": 64},
        "grpo": {"n_samples": a.samples, "beta": 0.1, "temperature": 1.0},
        "rewards": {"functions": [{"name": "thinking", "weight": 1.0}]},  # no math-verify needed
        "rollout": {"engine": "embedded_server", "device": device, "batch_size": a.prompts,
                    "max_new_tokens": a.new_tokens, "engine_batch_size": max(256, a.prompts * a.samples),
                    "num_gpus": num_gpus, "max_restarts": 0, "startup_timeout_s": 600.0},
        "trainer": trainer, "memory": {"offload": "pinned"},
        "sync": {"transport": transport, "bucket_mb": a.bucket_mb},
        "metrics": {"progress": False, "tensorboard": False, "log_samples": 0},
    })


def state_bytes(mem) -> int:
    return sum(p.bytes for p in mem.plans.values())


def median(xs):
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------------------- phases
def phase_steps(a, run, res):
    from megaforge.metrics import Progress

    bar = Progress(a.steps, 0, "bench", False)
    steps = []
    for step in range(1, a.steps + 1):
        if step > 1 and time_left(a) < 90:
            res["notes"].append(f"steps: stopped after {step - 1} (budget)")
            break
        t = time.time()
        m = run.rl_step(step, bar)
        run.state["rl_step"] = step
        keep = {k: round(v, 4) for k, v in m.items() if k.startswith(("time/", "memory/"))}
        keep.update(tokens=float(run_tokens(m, a)), weight_version=m.get("weight_version"))
        steps.append(keep)
        say(f"step {step}: {time.time() - t:.1f}s  " + " ".join(f"{k}={v:.3f}" for k, v in keep.items() if k.startswith("time/")))
    steady = steps[1:] or steps
    share = [(s.get("time/offload", 0) + s.get("time/onload", 0) + s.get("time/sync", 0)) / s["time/step"] for s in steady]
    share_engine = [(s.get("time/release", 0) + s.get("time/resume", 0)) / s["time/step"] for s in steady]
    res["step"] = {"steps": steps, "share_offload_onload_sync": round(sum(share) / len(share), 4),
                   "share_engine_release_resume": round(sum(share_engine) / len(share_engine), 4),
                   "time_step_s": round(sum(s["time/step"] for s in steady) / len(steady), 3),
                   "steady_steps": len(steady) if len(steps) > 1 else 0}
    mem = run.trainer._mem
    if mem is not None and steady:
        b = state_bytes(mem)
        res["step"]["state_gib"] = round(b / GIB, 3)
        res["step"]["onload_gib_s"] = round(b / GIB / max(median([s["time/onload"] for s in steady]), 1e-9), 2)


def run_tokens(m, a) -> int:
    return int(m.get("response_len/mean", 0) * a.prompts * a.samples)


def phase_offload(a, run, res, dev):
    tr, eng = run.trainer, run.engine
    eng.release_memory(["weights", "kv_cache"])
    mem = tr._mem
    ons, offs = [], []
    for _ in range(a.rounds):
        tr.onload()
        ons.append(dict(mem.last))
        tr.offload()
        offs.append(dict(mem.last))
    b = offs[-1]["bytes"]
    res["offload"] = {"bytes_gib": round(b / GIB, 3),
                      "offload_gib_s": round(b / GIB / median([o["seconds"] for o in offs]), 2),
                      "onload_gib_s": round(b / GIB / median([o["seconds"] for o in ons]), 2),
                      "offload_s": [round(o["seconds"], 4) for o in offs], "onload_s": [round(o["seconds"], 4) for o in ons],
                      "chunks": {t: mem.chunks(t) for t in mem.plans}, "host_allocs": mem.stats["host_allocs"],
                      "host_gib": round(mem.host_bytes() / GIB, 3)}
    if dev.type == "cuda":
        res["offload"]["reserved_after_offload_gib"] = round(torch.cuda.memory_reserved(dev) / GIB, 3)
        free, total = torch.cuda.mem_get_info(dev)
        res["offload"]["device_used_after_offload_gib"] = round((total - free) / GIB, 3)
    say(f"offload {res['offload']['offload_gib_s']} GiB/s, onload {res['offload']['onload_gib_s']} GiB/s "
        f"({res['offload']['bytes_gib']} GiB)")


def phase_sync(a, run, res, engine, key: str, version0: int):
    from megaforge import memory
    from megaforge.sync import push_weights

    tr = run.trainer
    tr.onload(["weights"])
    engine.resume_memory(["weights"])
    secs, stats = [], None
    for k in range(a.rounds):
        with Stopwatch() as w:  # push_weights returns once every bucket is loaded
            stats = push_weights(tr, engine, a.bucket_mb << 20, version0 + k)
        secs.append(w.seconds)
    tr.offload(["weights"])
    memory.release_cached()
    res[key] = {"transport": engine.transport, "bytes_gb": round(stats["bytes"] / 1e9, 3), "buckets": stats["buckets"],
                "max_bucket_mb": round(stats["max_bucket_bytes"] / (1 << 20), 1),
                "gb_s": round(stats["bytes"] / 1e9 / median(secs), 2), "seconds": [round(s, 4) for s in secs]}
    say(f"sync {engine.transport}: {res[key]['gb_s']} GB/s ({res[key]['bytes_gb']} GB in {stats['buckets']} buckets)")


def phase_tms(a, run, res, dev):
    from megaforge.memory.tms import TmsOffloader

    tr = run.trainer
    tr.onload()  # every tensor resident: the pinned offloader is out of the way
    tms = TmsOffloader(tr.offload_entries, dev)
    with Stopwatch() as migration:
        tms.offload()
        tms.onload()
    ons, offs = [], []
    for _ in range(max(1, a.rounds - 1)):
        offs.append(dict(tms.offload()))
        ons.append(dict(tms.onload()))
    b = offs[-1]["bytes"]
    res["tms"] = {"bytes_gib": round(b / GIB, 3), "migration_s": round(migration.seconds, 3),
                  "pause_gib_s": round(b / GIB / median([o["seconds"] for o in offs]), 2),
                  "resume_gib_s": round(b / GIB / median([o["seconds"] for o in ons]), 2),
                  "pause_s": [round(o["seconds"], 4) for o in offs], "resume_s": [round(o["seconds"], 4) for o in ons]}
    say(f"tms pause {res['tms']['pause_gib_s']} GiB/s, resume {res['tms']['resume_gib_s']} GiB/s")


def phase_nccl(a, run, res, model_dir, out, dev):
    from megaforge import memory
    from megaforge.build import RunBuilder
    from megaforge.rollout import build_engine

    if dev.type == "cuda" and torch.cuda.device_count() < 2:
        res["nccl"] = {"skipped": f"needs 2 GPUs, {torch.cuda.device_count()} visible"}
        return
    cfg = build_config(a, out, model_dir, "cpu" if dev.type == "cpu" else "cuda", "nccl", "nccl",
                       num_gpus=0 if dev.type == "cpu" else 1)
    say("nccl: starting an engine server on the second GPU")
    eng = build_engine(RunBuilder(cfg).engine_spec(), run.tokenizer)
    try:
        before = memory.outside_torch_gib(dev)
        run.trainer.onload(["weights"])
        from megaforge.sync import push_weights

        with Stopwatch() as first:
            push_weights(run.trainer, eng, a.bucket_mb << 20, 1000)  # creates the weight-update group
        after = memory.outside_torch_gib(dev)
        run.trainer.offload(["weights"])
        phase_sync(a, run, res, eng, "nccl", 1001)
        res["nccl"].update(first_update_with_group_setup_s=round(first.seconds, 3),
                           outside_torch_gib_before=None if before is None else round(before, 3),
                           outside_torch_gib_after_group=None if after is None else round(after, 3),
                           communicator_gib=None if before is None else round(after - before, 3))
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    a = parse_args(argv)
    res: dict = {"tool": "bench_colocate", "notes": [], "targets": {"offload_gib_s": 40, "onload_gib_s": 40,
                                                                    "sync_gb_s": 50, "share": 0.05}}
    cuda = torch.cuda.is_available() and not a.tiny
    if not cuda and not a.tiny:
        res["notes"].append("no CUDA device: ran the --tiny CPU path")
        a = parse_args((argv or sys.argv[1:]) + ["--tiny"])
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    res["device"] = device_name(dev)
    res["workload"] = {"model_config": os.path.relpath(a.model_config, ROOT), "backend": a.backend,
                       "prompts": a.prompts, "samples": a.samples, "new_tokens": a.new_tokens, "bucket_mb": a.bucket_mb}
    out = tempfile.mkdtemp(prefix="bench-colocate-")
    run = None
    try:
        say("random weights")  # saved once for the trainer and the engine servers
        model_dir, n = write_random_model(model_config(a.model_config), torch.float32 if a.tiny else torch.bfloat16,
                                          dev, tempfile.mkdtemp(prefix="bench-colocate-model-"))
        res["workload"]["params_b"] = round(n / 1e9, 3)
        from megaforge.loop import Run
        from megaforge.rewards import RewardManager
        from megaforge.data.prompts import PromptSource
        from megaforge.rollout.manager import stop_token_ids

        cfg = build_config(a, out, model_dir, "cuda" if cuda else "cpu", "ipc" if cuda else "shm", "colocated")
        say("trainer")
        run = Run(cfg, "grpo")
        if not cuda:  # the copy engine on CPU-emulated buffers (memory.offload pinned is a no-op on a CPU trainer)
            from megaforge.memory.offload import PinnedOffloader

            run.trainer._mem = PinnedOffloader(run.trainer.offload_entries, "cpu")
        say("engine server")
        run.engine = run._build_engine()
        run.data = PromptSource(cfg.data, run.tokenizer, cfg.seed)
        run.rewards = RewardManager(cfg.rewards)
        run.trainer.reset_optimizer(cfg.trainer.lr, cfg.max_steps, 0, "constant")
        run.trainer.snapshot_reference()
        run.stop_ids = stop_token_ids(run.tokenizer, cfg.model.path)
        run.start_driver()  # the trainer's weights pushed, the step driver
        for name, phase in (("steps", lambda: phase_steps(a, run, res)),
                         ("offload", lambda: phase_offload(a, run, res, dev)),
                         ("sync", lambda: phase_sync(a, run, res, run.engine, "sync", 100)),
                         ("nccl", lambda: phase_nccl(a, run, res, model_dir, out, dev) if a.nccl else None),
                         ("tms", lambda: None if a.no_tms else phase_tms(a, run, res, dev))):
            need = {"nccl": 90, "tms": 45}.get(name, 20)  # seconds a phase may take at most
            if time_left(a) < need:
                res.setdefault(name, {"skipped": f"time budget: {time_left(a):.0f} s left of --budget, {need} s needed"})
                continue
            try:
                phase()
            except Exception as e:  # noqa: BLE001  (a phase that fails is reported, the others still run)
                res[name] = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
                say(f"{name} failed:\n{traceback.format_exc()}")
                if name == "steps":
                    break
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        say(traceback.format_exc())
    finally:
        if run is not None and run.engine is not None:
            try:
                run.engine.shutdown()
            except Exception:  # noqa: BLE001
                pass
    ok = res.get("offload", {}), res.get("sync", {}), res.get("step", {})
    res["meets"] = {"offload": ok[0].get("offload_gib_s", 0) >= 40 and ok[0].get("onload_gib_s", 0) >= 40,
                    "sync": ok[1].get("gb_s", 0) >= 50, "share": 0 < ok[2].get("share_offload_onload_sync", 1) <= 0.05}
    res["wall_s"] = round(time.time() - T0, 1)
    emit(res, dev)
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
