"""Metric sinks (jsonl, TensorBoard, W&B) and the progress display.

``<run dir>/metrics.jsonl`` holds one JSON object per RL step (``sft_metrics.jsonl`` for the warm
start). On resume the file is cut back to the checkpoint's step, so no step appears twice; a
``--resume`` that finds no checkpoint starts the file again. The rows so removed (steps a killed
attempt ran after its last checkpoint) are not lost: they are appended to ``metrics.superseded.jsonl``
(``sft_metrics.superseded.jsonl``) beside it, each with ``"superseded_at"`` (unix time). Before a
resume loads anything, :func:`set_aside_bad_rows` moves rows that are not a JSON object with a numeric
``step`` (not UTF-8, malformed, a line cut by a crash) to ``metrics.jsonl.bad``, byte for byte.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

from megaforge.config.run import MetricsConfig
from megaforge.configtree import to_dict
from megaforge.specs import expect

REQUIRED_KEYS = (
    "step", "reward/mean", "loss", "kl", "entropy", "clip_frac", "response_len/mean",
    "train_rollout_logprob_abs_diff", "time/rollout", "time/train", "time/sync", "time/offload",
    "time/onload", "time/step", "throughput/tokens_per_s",
)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def _read_jsonl(path: str) -> list[dict]:
    """The records of a jsonl file, a line cut by a crash left out."""
    recs = []
    with open(path) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash (or a blank line)
    return recs


def _replace_jsonl(path: str, recs: list[dict]) -> None:
    """Write ``recs`` as ``path`` atomically: a temporary file, fsynced, then renamed over it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def bad_rows_path(path: str) -> str:
    """``metrics.jsonl`` -> ``metrics.jsonl.bad``: where :func:`set_aside_bad_rows` keeps the rows it moves."""
    return path + ".bad"


def _row_problem(line: bytes) -> Optional[str]:
    """None when ``line`` is a metrics row (a JSON object whose ``step`` is a finite number), else what it is."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 (byte {e.start})"
    except ValueError as e:
        return f"not JSON ({e})"
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
        return f"its step is {step!r}, not a number"
    return None


def _ended(line: bytes) -> bytes:
    return line if line.endswith((b"\n", b"\r")) else line + b"\n"


def set_aside_bad_rows(path: str) -> list[str]:
    """Move the lines of jsonl file ``path`` that are not metrics rows (:func:`_row_problem`; blank lines
    stay) to :func:`bad_rows_path`, appended as they were (fsynced before ``path`` is rewritten without
    them, atomically): nothing written is lost. Returns one message per moved line, naming the file, the
    line number and what is wrong ([] when every line is a row, or there is no file)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    bad = [(i, line, why) for i, line in enumerate(lines, 1) if line.strip()
           for why in [_row_problem(line)] if why is not None]
    if not bad:
        return []
    side = bad_rows_path(path)
    with open(side, "ab") as f:
        f.write(b"".join(_ended(line) for _, line, _ in bad))
        f.flush()
        os.fsync(f.fileno())
    moved = {i for i, _, _ in bad}
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"".join(_ended(line) for i, line in enumerate(lines, 1) if i not in moved))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return [f"{path} line {i}: {why}; moved to {side} (kept byte for byte)" for i, _, why in bad]


def superseded_path(path: str) -> str:
    """``metrics.jsonl`` -> ``metrics.superseded.jsonl``: where :func:`truncate_jsonl` keeps what it drops."""
    return (path[:-len(".jsonl")] if path.endswith(".jsonl") else path) + ".superseded.jsonl"


def truncate_jsonl(path: str, keep_upto_step: float) -> int:
    """Drop lines whose ``step`` is greater than ``keep_upto_step`` (-inf: every line; atomic rewrite),
    after appending them, each with ``"superseded_at"``, to :func:`superseded_path` (fsynced first: a
    crash between the two writes duplicates rows there, never loses them). Returns how many went."""
    if not os.path.exists(path):
        return 0
    recs = _read_jsonl(path)
    keep = [r for r in recs if r.get("step", 0) <= keep_upto_step]
    dropped = [dict(r, superseded_at=round(time.time(), 3)) for r in recs if r.get("step", 0) > keep_upto_step]
    if dropped:
        with open(superseded_path(path), "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in dropped))
            f.flush()
            os.fsync(f.fileno())
    _replace_jsonl(path, keep)
    return len(dropped)


class MetricsLogger:
    """Writes step records to every configured sink (main rank only). ``metrics``: the ``metrics``
    section (a MetricsConfig); ``run_name`` and ``flat`` (the flattened config, :func:`flat_config`)
    name and describe the wandb run."""

    def __init__(self, metrics, run_dir: str, filename: str = "metrics.jsonl", resume_step: Optional[int] = None,
                 tb_subdir: str = "tensorboard", run_name: str = "run", flat: Optional[dict] = None):
        self.cfg = expect(metrics, MetricsConfig, "MetricsLogger")
        self.path = os.path.join(run_dir, filename)
        # resumed: rows after the checkpoint's step go; a fresh start in an old directory (a --resume that
        # found no checkpoint): every row goes. Either way they are kept in superseded_path(self.path).
        dropped = truncate_jsonl(self.path, resume_step if resume_step is not None else -math.inf)
        if dropped:
            what = (f"steps after {resume_step}, the checkpoint resumed from" if resume_step is not None
                    else "an earlier attempt that left no checkpoint")
            print(f"[megaforge] {self.path}: {dropped} rows ({what}) moved to {superseded_path(self.path)}", flush=True)
        self._f = open(self.path, "a")
        self.tb = None
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, tb_subdir), purge_step=resume_step + 1 if resume_step else None)
        self.wandb = None
        if self.cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("metrics.wandb is true but wandb is not installed: pip install wandb") from e
            self.wandb = wandb.init(project=self.cfg.wandb_project, name=run_name, dir=run_dir,
                                    mode=self.cfg.wandb_mode, config=flat or {}, resume="allow")

    def log(self, step: int, metrics: dict) -> None:
        rec = {"step": step, **{k: _clean(v) for k, v in metrics.items() if k != "step"}}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._to_dashboards(step, rec)

    def amend(self, step: int, metrics: dict) -> None:
        """Merge ``metrics`` into the jsonl row of ``step`` (the last such row; a new row when there is
        none), by an atomic rewrite: a deferred evaluation joins the row of the step it evaluates."""
        add = {k: _clean(v) for k, v in metrics.items() if k != "step"}
        self._f.close()
        rows = _read_jsonl(self.path)
        at = [i for i, r in enumerate(rows) if r.get("step") == step]
        if at:
            rows[at[-1]].update(add)
        else:
            rows.append({"step": step, **add})
        _replace_jsonl(self.path, rows)
        self._f = open(self.path, "a")
        self._to_dashboards(step, {"step": step, **add})

    def _to_dashboards(self, step: int, rec: dict) -> None:
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if k != "step"}, step=step)

    def close(self) -> None:
        self._f.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def flat_config(tree) -> dict:
    """``{"section.key": value}`` of a config tree (what wandb shows as the run's config)."""
    out = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, prefix + k + ".")
            else:
                out[prefix + k] = v

    walk(to_dict(tree))
    return out


class Progress:
    """A tqdm bar over steps showing the newest reward, loss and step time."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, unit="step")

    def update(self, metrics: dict, keys=("reward/mean", "loss", "time/step")) -> None:
        if self.bar is None:
            return
        post = {}
        for k in keys:
            if k in metrics and metrics[k] is not None:
                post[k.split("/")[-1] if k != "time/step" else "step_s"] = f"{metrics[k]:.3g}"
        self.bar.set_postfix(post)
        self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def write_err(self, text: str) -> None:
        """``text`` on stderr (above the bar)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_summary(run_dir: str) -> str:
    """The end-of-run line: the run folder, the SFT loss and the RL reward/mean from their first to their
    last logged step (``sft_metrics.jsonl``, ``metrics.jsonl``), and the command that plots the curves."""
    parts = [f"megaforge: done: {run_dir}"]
    for name, key, label in (("sft_metrics.jsonl", "loss", "SFT loss"), ("metrics.jsonl", "reward/mean", "reward/mean")):
        path = os.path.join(run_dir, name)
        rows = [r for r in (_read_jsonl(path) if os.path.exists(path) else []) if isinstance(r.get(key), (int, float))]
        if rows:
            first, last = rows[0], rows[-1]
            phase = "SFT" if name.startswith("sft") else "RL"
            parts.append(f"{label} {first[key]:.3g} -> {last[key]:.3g} ({phase} steps {first.get('step')}-{last.get('step')})")
    parts.append(f"curves: python tools/plot_run.py {run_dir}")
    return "; ".join(parts)
