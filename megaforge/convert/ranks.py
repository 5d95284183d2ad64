"""Run a conversion CLI as N ranks of one process group: under ``torchrun`` (the environment is
already there) or by spawning the ranks itself.

``spawn(script, argv, nprocs)`` starts ``python script argv...`` ``nprocs`` times with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, a free
``MASTER_PORT``); the ranks' output goes to this process's stdout / stderr. When one rank fails, the
others are stopped (they may be blocked in a collective) and the first failure's exit code is
returned; ``on_failure`` then runs in the parent (the CLIs remove half-written output there, so
nothing is left even when a rank was killed mid-write).
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

#: the CLIs' --dtype names -> torch dtype attribute names
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}


@dataclass
class Layout:
    """A Megatron layout to convert to / load at (context parallel 1)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel (None: = tp, megatron's default)

    def world(self) -> int:
        """Smallest world holding this layout: PP x lcm(TP, ETP x EP); the other ranks of a
        larger world are data-parallel replicas."""
        etp = self.tp if self.etp is None else self.etp
        return self.pp * math.lcm(self.tp, etp * self.ep)


def leftovers(out: str) -> list[str]:
    """Temporary folders of an interrupted write into ``out`` (``.NAME.tmp-*`` / ``.NAME.old-*``
    next to it, see :func:`megaforge.convert.hf_writer.atomic_output_dir`)."""
    out = os.path.abspath(out.rstrip("/"))
    parent, name = os.path.split(out)
    if not os.path.isdir(parent):
        return []
    return sorted(f for f in os.listdir(parent) if f.startswith(f".{name}.tmp-") or f.startswith(f".{name}.old-"))


def remove_leftovers(out: str) -> None:
    parent = os.path.dirname(os.path.abspath(out.rstrip("/")))
    for f in leftovers(out):
        shutil.rmtree(os.path.join(parent, f), ignore_errors=True)


def missing_checkpoint_files(ckpt: str) -> list[str]:
    """Data files that a torch_dist checkpoint's ``.metadata`` names but that are absent, each with
    a few of the tensors stored in it (a cheap check the CLI runs before starting any rank)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ckpt).read_metadata()
    files: dict[str, set] = {}
    for idx, info in (md.storage_data or {}).items():
        files.setdefault(info.relative_path, set()).add(idx.fqn)
    out = []
    for f, keys in sorted(files.items()):
        if not os.path.exists(os.path.join(ckpt, f)):
            ks = sorted(keys)
            out.append(f"missing shard file {os.path.join(ckpt, f)} (holds data of {len(ks)} tensors: "
                       f"{', '.join(ks[:4])}{' ...' if len(ks) > 4 else ''})")
    return out


def in_rank() -> bool:
    """True inside a rank (torchrun or :func:`spawn`), False in a plain CLI process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(script: str, argv: list[str], nprocs: int, on_failure: Optional[Callable[[], None]] = None,
          threads_per_rank: Optional[int] = None, grace_s: float = 5.0) -> int:
    """Run ``nprocs`` ranks of ``script``; returns 0 or the first failing rank's exit code."""
    port = _free_port()
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
    procs = []
    for r in range(nprocs):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        procs.append(subprocess.Popen([sys.executable, script] + list(argv), env=env))
    code = 0
    try:
        while True:
            states = [p.poll() for p in procs]
            bad = [c for c in states if c not in (None, 0)]
            if bad:
                code = bad[0]
                deadline = time.time() + grace_s  # let the peers fail on their own first
                while time.time() < deadline and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                break
            if all(c == 0 for c in states):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if code and on_failure is not None:
        on_failure()
    return code


def rank_setup() -> None:
    """At the start of a converter rank: silence megatron's import-time notices (Apex / TE absent,
    deprecations) and torch.distributed.checkpoint's ShardedTensor deprecation, which every rank
    would print; turn SIGTERM (a peer failed; torchrun or :func:`spawn` stops us) into SystemExit,
    so ``finally`` / ``except`` clean-ups run."""
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def rank_done(message: str) -> None:
    """At the end of a converter rank: rank 0 prints ``message``; every rank leaves the group."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(message, flush=True)
    dist.destroy_process_group()
