"""How long a run's checkpoint takes: the write, the manifest's checksums, a resume's verification and load.

    torchrun --nproc_per_node 1 tools/bench/bench_checkpoint.py --config configs/grpo_h200_colocated.yaml
    python tools/bench/bench_checkpoint.py --config configs/demo_cpu.yaml --dir /tmp/ckpt    # CPU, the torch trainer

The config's trainer is built as a run builds it (``model.path`` or a random init; no engine), its
optimizer state materialised as a fresh run's first checkpoint has it, then, timed apart:

* ``save_s``: ``megaforge.checkpoint.save`` into ``--dir`` (the backend's files, RNG, loop state, then
  the manifest's sha256 of every file, in pieces on a thread pool);
* ``verify_s``: ``checkpoint.verify`` as ``--resume`` runs it (every file read and hashed again; the
  files are likely still in the page cache, as on a resume right after a save);
* ``load_s``: ``checkpoint.load`` into the same trainer, in this process: memory the save freed may be
  reused, so a resume's load in a new process can take longer (CPU, a 2.6 GB Megatron checkpoint:
  11-13 s in a new process, 5-8 s here).

``bytes`` is the checkpoint's size on disk, ``write_gb_s`` = bytes / save_s, ``hash_gb_s`` = bytes /
verify_s; ``host_peak_rss_gib`` is this process's peak resident memory (ru_maxrss) after each phase,
``mem_available_gib`` the host's (/proc/meminfo) before the save and after it. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import ROOT, Stopwatch, emit, stage_logger  # noqa: E402

say = stage_logger("bench_checkpoint")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a run config (its model, trainer and checkpoint sections)")
    p.add_argument("--dir", default=None, help="where to write (default: a new folder under the system's temp dir); "
                                               "put it on the filesystem the run's output_dir uses")
    p.add_argument("--keep", action="store_true", help="leave the checkpoint in --dir")
    return p.parse_known_args(argv)


def _peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # kB on Linux


def _mem_available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    a, over = parse_args(argv)
    from megaforge import checkpoint, collective
    from megaforge.config import load_config
    from megaforge.loop import Run

    out = a.dir or tempfile.mkdtemp(prefix="bench-checkpoint-")
    cfg = load_config(["--config", a.config, *over, "--output_dir", os.path.join(out, "run"), "--run_name", "bench",
                       "--max_steps", "0", "--metrics.progress", "false"])
    say("trainer")
    run = Run(cfg, "grpo")
    dev = run.trainer.device
    ckpts = os.path.join(out, "checkpoints")
    res = {"bench": "checkpoint", "config": os.path.relpath(os.path.abspath(a.config), ROOT), "overrides": over,
           "backend": cfg.trainer.backend, "dir": out, "world": collective.world(),
           "hash_threads": checkpoint.hash_threads(), "piece_bytes": checkpoint.PIECE_BYTES,
           "mem_available_gib_before": _mem_available_gib()}
    try:
        say(f"save into {ckpts}")
        with Stopwatch(dev) as w:
            path = checkpoint.save(ckpts, 1, run.trainer, dict(run.state, rl_step=1), keep_last_n=1)
        save_s = w.seconds
        res["save_s"] = round(save_s, 2)
        res["host_peak_rss_gib_after_save"] = _peak_rss_gib()
        res["mem_available_gib_after_save"] = _mem_available_gib()
        res["bytes"] = _bytes(path) if collective.is_main() else None
        say(f"saved {res['bytes'] / 1e9 if res['bytes'] else 0:.2f} GB in {w.seconds:.1f} s; verify")
        if collective.is_main():
            with Stopwatch() as w:
                why = checkpoint.verify(path)
            if why is not None:
                raise RuntimeError(f"the checkpoint just written does not verify: {why}")
            verify_s = w.seconds
            res["verify_s"] = round(verify_s, 2)
        collective.barrier()
        say("load")
        with Stopwatch(dev) as w:
            checkpoint.load(path, run.trainer)
        res["load_s"] = round(w.seconds, 2)
        res["host_peak_rss_gib_after_load"] = _peak_rss_gib()
        if res["bytes"]:
            res["write_gb_s"] = round(res["bytes"] / 1e9 / save_s, 3)
            res["hash_gb_s"] = round(res["bytes"] / 1e9 / verify_s, 3)
        if collective.is_main():
            emit(res, dev)
    finally:
        run.close()
        if not a.keep and collective.is_main():
            shutil.rmtree(ckpts, ignore_errors=True)
            if a.dir is None:
                shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
