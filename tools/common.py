"""What the benchmark and check tools share: the checkout's paths, one JSON line per result with its
provenance (:func:`emit`), progress lines on stderr, device timing (:class:`Stopwatch`,
:func:`time_per_call`, the median of timed runs :func:`timed_runs`), peak device memory (:class:`PeakMemory`), synthetic RL batches
(:func:`rl_batch`) and random-weight models of ``configs/models/`` or of a tool's own shape
(:func:`model_config`, :func:`random_model`, :func:`write_random_model`).

The tools run as scripts (``python tools/x.py``, ``torchrun tools/x.py``: this folder is then the
first entry of ``sys.path``, so ``from common import ...`` finds this file; the benchmarks in
``tools/bench/`` put this folder on ``sys.path`` after their own) and import megaforge as installed
(``pip install -e .``) or from ``PYTHONPATH`` (the GPU machine: ``PYTHONPATH=$PWD``).
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "configs", "models")
GIB = float(1 << 30)
_SHA = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # SHA-1, or SHA-256 object names


# ------------------------------------------------------------------------------------- provenance
def _git(root: str, *args: str) -> Optional[str]:
    """stdout of ``git -C root args`` (stripped), None when git is missing or fails."""
    try:
        p = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _head_from_files(root: str) -> Optional[str]:
    """HEAD's commit read from ``root/.git`` without git: a ``.git`` folder, or a worktree's ``.git``
    file (``gitdir: PATH``); HEAD detached or naming a ref (loose, or in packed-refs)."""
    dot = os.path.join(root, ".git")
    gitdir = dot
    if os.path.isfile(dot):
        line = _read(dot) or ""
        if not line.startswith("gitdir:"):
            return None
        gitdir = os.path.join(root, line[len("gitdir:"):].strip())
    head = _read(os.path.join(gitdir, "HEAD"))
    if head is None:
        return None
    if not head.startswith("ref:"):
        return head if _SHA.fullmatch(head) else None
    ref = head[len("ref:"):].strip()
    common = os.path.join(gitdir, _read(os.path.join(gitdir, "commondir")) or ".")  # worktrees share refs
    for d in (gitdir, common):
        sha = _read(os.path.join(d, ref))
        if sha and _SHA.fullmatch(sha):
            return sha
    for line in (_read(os.path.join(common, "packed-refs")) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == ref and _SHA.fullmatch(parts[0]):
            return parts[0]
    return None


def commit(root: str = ROOT) -> str:
    """The commit of the checkout at ``root``:

    * ``$MEGAFORGE_COMMIT`` when set (a copy of the tree without ``.git``, made from a known commit);
    * ``git rev-parse HEAD``, with ``-dirty`` appended when ``git status --porcelain`` lists changes
      (untracked files included), where git runs and ``root`` is the top of its checkout;
    * else HEAD read from ``root/.git``'s files, with ``-unverified`` appended (git could not say
      whether the tree matches it);
    * else ``"unknown"`` (no git checkout: e.g. the GPU machine's copy of the working tree).
    """
    given = os.environ.get("MEGAFORGE_COMMIT", "").strip()
    if given:
        return given
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is not None and os.path.realpath(top) == os.path.realpath(root):
        sha = _git(root, "rev-parse", "HEAD")
        status = _git(root, "status", "--porcelain")
        if sha and status is not None:
            return sha + ("-dirty" if status else "")
    if top is not None and os.path.realpath(top) != os.path.realpath(root):
        return "unknown"  # root is a plain folder inside another repository's checkout
    sha = _head_from_files(root)
    return f"{sha}-unverified" if sha else "unknown"


def _version(name: str) -> Optional[str]:
    """The version of an imported module, else of its installed distribution, else None."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _megaforge() -> Optional[str]:
    """megaforge's version, with the folder it was imported from when that is not this checkout's
    (then ``commit`` does not describe the code that ran); None where it is not importable (a tool
    that does not use it)."""
    try:
        import megaforge
    except ImportError:
        return None
    where = os.path.dirname(os.path.abspath(megaforge.__file__))
    same = os.path.realpath(where) == os.path.realpath(os.path.join(ROOT, "megaforge"))
    return megaforge.__version__ if same else f"{megaforge.__version__} ({where})"


@functools.lru_cache(maxsize=None)
def _static_provenance() -> tuple:
    return commit(), _version("torch"), _megaforge()


def device_name(device=None) -> str:
    """The GPU's name of a CUDA ``device`` (``"NVIDIA H200"``), else the device type (``"cpu"``).
    Without ``device``: the current CUDA device when this process has used CUDA, else ``"cpu"``."""
    torch = sys.modules.get("torch")
    if device is None:
        if torch is None or not torch.cuda.is_initialized():
            return "cpu"
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def provenance(device=None) -> dict:
    """``{"commit", "device", "torch", "megaforge"}`` of this run (see :func:`commit`,
    :func:`device_name`; versions as imported, else as installed, else None)."""
    sha, torch_version, megaforge_version = _static_provenance()
    return {"commit": sha, "device": device_name(device), "torch": torch_version, "megaforge": megaforge_version}


def emit(record: dict, device=None, file=None) -> dict:
    """Print ``record`` as one JSON line (flushed) with its ``"provenance"`` (:func:`provenance` of
    ``device``) added; returns the dict printed. ``file``: default stdout."""
    if "provenance" in record:
        raise ValueError("emit: the record already has a 'provenance' key")
    line = {**record, "provenance": provenance(device)}
    print(json.dumps(line), file=file or sys.stdout, flush=True)
    return line


def stage_logger(tool: str) -> Callable[[str], None]:
    """``say(msg)``: ``[tool   12.3s] msg`` on stderr, seconds since this call; in a process group
    only its rank 0 prints."""
    t0 = time.time()

    def say(msg: str) -> None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        print(f"[{tool} {time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return say


# ------------------------------------------------------------------------------- timing and memory
def sync(device) -> None:
    """Wait for the CUDA work queued on ``device`` (nothing to wait for elsewhere, or for None)."""
    if device is not None:
        import torch

        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)


class Stopwatch:
    """``with Stopwatch(dev) as w: ...`` then ``w.seconds``: wall time of the block, the device's
    queued work finished before it starts and before it ends (see :func:`sync`)."""

    def __init__(self, device=None):
        self.device, self.seconds = device, None

    def __enter__(self) -> "Stopwatch":
        sync(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        sync(self.device)
        self.seconds = time.perf_counter() - self._t0
        return False


def _group():
    """torch.distributed when a process group is up, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def time_per_call(fn: Callable[[], object], warmup: int, steps: int, device, across_ranks: bool = True) -> float:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then the mean of ``steps`` timed ones
    (device work finished). In a process group (and ``across_ranks``) the ranks start the timed
    calls together (a barrier) and the slowest rank's mean is returned on every rank."""
    import torch

    for _ in range(warmup):
        fn()
    dist = _group() if across_ranks else None
    sync(device)
    if dist is not None:
        dist.barrier()
    with Stopwatch(device) as w:
        for _ in range(steps):
            fn()
    dt = w.seconds / steps
    if dist is not None:
        t = torch.tensor([dt], device=device)  # NCCL reduces device tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dt = float(t)
    return dt


def timed_runs(runs: list[tuple[int, float]]) -> dict:
    """The median run by tok/s (the lower middle one of an even count) of (tokens, seconds) timed runs
    (``tok_s``, ``wall_s``, ``tokens``) and every run's tok/s (``tok_s_runs``, in order)."""
    rates = [t / w for t, w in runs]
    mid = sorted(range(len(runs)), key=lambda i: rates[i])[(len(runs) - 1) // 2]
    return {"tok_s": round(rates[mid], 1), "wall_s": round(runs[mid][1], 3), "tokens": runs[mid][0],
            "tok_s_runs": [round(r, 1) for r in rates]}


class PeakMemory:
    """``with PeakMemory(dev) as pk: ...`` then ``pk.gib``: the CUDA allocator's peak of allocated
    bytes during the block, GiB (its peak counter reset at entry), and ``pk.above_start_gib``: that
    peak less the bytes allocated at entry. With ``across_ranks``, both are the maximum over the
    process group's ranks. None on other devices, and when the block raised."""

    def __init__(self, device, across_ranks: bool = False):
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.across_ranks = across_ranks
        self.gib = self.above_start_gib = None

    def __enter__(self) -> "PeakMemory":
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> bool:
        import torch

        if self.cuda and exc[0] is None:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            t = torch.tensor([peak / GIB, (peak - self._start) / GIB], device=self.device)
            dist = _group() if self.across_ranks else None
            if dist is not None:
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.gib, self.above_start_gib = (float(x) for x in t)
        return False


# ----------------------------------------------------------------------------------- RL batches
def rl_batch(lengths, vocab: int, prompt_lens, width: Optional[int] = None, generator=None, seed: int = 0):
    """A random RL :class:`~megaforge.types.TrainBatch` of ``len(lengths)`` rows, [B, T] with
    T = ``width`` (default ``max(lengths)``), right-padded with token 0:

    * tokens uniform in [0, vocab) before ``lengths[b]``;
    * loss mask 1 on prompt_lens[b] <= t < lengths[b] (the response; ``prompt_lens = lengths``: none);
    * advantages: one N(0, 1) draw per row, on the mask; rollout logprobs -2 + 0.1 N(0, 1), on the mask;
    * ``num_tokens`` = the mask's sum, ``num_seqs`` = rows with a masked token (this batch is global).

    Draws in that order from ``generator`` (default: a new one seeded with ``seed``)."""
    import torch

    from megaforge.types import TrainBatch

    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    prompt_lens = torch.as_tensor(prompt_lens, dtype=torch.long).expand(lengths.shape)
    B, T = len(lengths), int(width if width is not None else lengths.max())
    t = torch.arange(T)[None]
    valid = t < lengths[:, None]
    tokens = torch.randint(0, vocab, (B, T), generator=g) * valid
    mask = (valid & (t >= prompt_lens[:, None])).float()
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    roll = (-2.0 + 0.1 * torch.randn(B, T, generator=g)) * mask
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=adv.contiguous(),
                      rollout_logprobs=roll, num_tokens=int(mask.sum()), num_seqs=int((mask.sum(1) > 0).sum()))


# --------------------------------------------------------------------------------- random models
def model_config(source, **overrides):
    """A transformers config: ``source`` a name under ``configs/models/`` (``"qwen3-1.7b"``), a
    folder holding a ``config.json``, or a dict of config fields with its ``model_type`` (a shape a
    tool defines); ``overrides`` (config fields) on top."""
    from transformers import AutoConfig

    if isinstance(source, dict):
        fields = {**source, **overrides}
        if "model_type" not in fields:
            raise ValueError(f"model_config: a shape needs 'model_type' (fields: {sorted(fields)})")
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    for folder in (source, os.path.join(MODELS, str(source))):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return AutoConfig.from_pretrained(folder, **overrides)
    names = sorted(n for n in os.listdir(MODELS) if os.path.isdir(os.path.join(MODELS, n)))
    raise FileNotFoundError(f"model_config: {source!r} is neither a folder with a config.json nor one of "
                            f"configs/models/: {', '.join(names)}")


def random_model(config, dtype, device="cpu", seed: int = 0):
    """``AutoModelForCausalLM`` of ``config`` with random weights (``torch.manual_seed(seed)``; the
    CPU generator's state is restored after), built on ``device`` in ``dtype``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):  # on the GPU: seconds instead of minutes on one CPU core
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def write_random_model(config, dtype, device="cpu", out: Optional[str] = None, seed: int = 0) -> tuple[str, int]:
    """:func:`random_model` saved (``save_pretrained``) into ``out`` (default: a new temporary
    folder): (folder, parameter count)."""
    out = out or tempfile.mkdtemp(prefix="megaforge-random-model-")
    model = random_model(config, dtype, device, seed)
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    return out, n
