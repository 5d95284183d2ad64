"""Plot a run's curves to PNG.

    python tools/plot_run.py RUN_DIR [--out FILE.png] [--keys reward/mean,loss,...] [--eval_only]
    python tools/plot_run.py --overlay LABEL=METRICS.jsonl [--overlay ...] --keys eval/gsm8k_test/greedy/pass@1 --out F.png

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per step) and ``RUN_DIR/sft_metrics.jsonl`` (the SFT
phase: warm start or SFT run) and writes a grid of line plots, one per metric, to ``RUN_DIR/curves.png``
by default: the SFT phase's curves first (``sft/loss``, ``sft/grad_norm``, ``sft/lr``, over SFT steps), then RL's. The held-out evaluation's curves (``eval/<set>/...``:
greedy pass@1, sampled pass@k, greedy reward and response length; points at the evaluated steps, step 0
= before training) follow the training curves; ``--eval_only`` plots only them.

``--overlay`` puts several runs on the same axes instead, one panel per key of ``--keys`` and one line per
run (e.g. a distillation run's greedy pass@1 beside a GRPO run's, by step); a run without a key is an
error naming its file and the keys it has.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEFAULT_KEYS = ["reward/mean", "loss", "kl", "entropy", "clip_frac", "response_len/mean",
                "train_rollout_logprob_abs_diff", "time/step", "throughput/tokens_per_s"]


SFT_KEYS = ["loss", "grad_norm", "lr"]
EVAL_SUFFIXES = ("/greedy/pass@1", "/greedy/reward/mean", "/greedy/response_len/mean")


def eval_keys(recs: list[dict]) -> list[str]:
    """The evaluation curves present: per set, greedy pass@1, sampled pass@k (by k), greedy reward and
    response length."""
    keys = {k for r in recs for k in r if k.startswith("eval/") and (k.endswith(EVAL_SUFFIXES) or "/sampled/pass@" in k)}

    def order(k: str):
        head, _, tail = k.rpartition("/")
        if "/sampled/pass@" in k:
            return (head.rsplit("/", 1)[0], 1, int(tail.removeprefix("pass@")))
        return (head.rsplit("/", 1)[0], 0 if k.endswith("pass@1") else 2 if "/reward/" in k else 3, k)

    return sorted(keys, key=order)


def read_jsonl(path: str) -> list[dict]:
    """The records of a jsonl file (a line that is not JSON is skipped, named on stderr)."""
    recs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"plot_run: {path}:{i} is not valid JSON; skipped", file=sys.stderr)
    return recs


def load(run_dir: str) -> list[dict]:
    """The RL records of ``metrics.jsonl`` and the SFT phase's of ``sft_metrics.jsonl``, the latter with
    their keys prefixed ``sft/`` (their ``step``: the SFT step)."""
    path, sft_path = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "sft_metrics.jsonl")
    if not os.path.exists(path) and not os.path.exists(sft_path):
        raise SystemExit(f"plot_run: {path} does not exist (nor {os.path.basename(sft_path)})")
    recs = read_jsonl(path) if os.path.exists(path) else []
    if os.path.exists(sft_path):
        recs = [{"step": r.get("step"), **{f"sft/{k}": v for k, v in r.items() if k != "step"}}
                for r in read_jsonl(sft_path)] + recs
    if not recs:
        raise SystemExit(f"plot_run: {path} holds no records")
    return recs


def save(fig, out: str, title: str = "", dpi: int = 100) -> str:
    """``fig`` (its ``title`` on top) written to ``out`` through a temporary file (a reader never sees
    half a PNG), then closed."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def plot(recs: list[dict], keys: list[str], out: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in recs)]
    if not keys:
        raise SystemExit("plot_run: none of the requested metrics are in the file")
    cols = 3
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        pts = [(r["step"], r[k]) for r in recs if isinstance(r.get(k), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5, marker="o" if k.startswith("eval/") else None,
                ms=3)
        ax.set_title(k, fontsize=10)
        ax.set_xlabel("SFT step" if k.startswith("sft/") else "step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    return save(fig, out, title)


def overlay_series(runs: list[tuple[str, str, list[dict]]], key: str) -> dict[str, list[tuple[int, float]]]:
    """{label: [(step, value), ...]} of ``key`` in each (label, metrics.jsonl path, its records) of ``runs``
    (:func:`parse_overlay`), in step order."""
    out = {}
    for label, path, recs in runs:
        pts = sorted((r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float)) and "step" in r)
        if not pts:
            have = sorted({k for r in recs for k in r if k.startswith(key.split("/")[0])})[:12]
            raise SystemExit(f"plot_run: {path} ({label}) has no {key!r} (keys of that kind there: {have or 'none'})")
        out[label] = pts
    return out


def plot_overlay(runs: list[tuple[str, str, list[dict]]], keys: list[str], out: str, title: str = "") -> str:
    """One panel per key, one line per run (label in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(6.0 * len(keys), 4.0), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        for label, pts in overlay_series(runs, k).items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5, marker="o" if k.startswith("eval/") else None,
                    ms=4, label=label)
        ax.set_title(k, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, out, title, dpi=90)


def parse_overlay(items: list[str]) -> list[tuple[str, str, list[dict]]]:
    """``LABEL=PATH`` items -> [(label, path, its records)], each file read once for every key drawn; a
    missing ``=`` or file is an error naming the item."""
    runs = []
    for it in items:
        label, sep, path = it.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"plot_run: --overlay {it!r} is not LABEL=METRICS.jsonl")
        if not os.path.exists(path):
            raise SystemExit(f"plot_run: --overlay {label}: {path} does not exist")
        runs.append((label, path, read_jsonl(path)))
    return runs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="training curves (the eval curves follow)")
    ap.add_argument("--eval_only", action="store_true", help="only the held-out evaluation's curves")
    ap.add_argument("--overlay", action="append", default=[], metavar="LABEL=METRICS.jsonl",
                    help="runs on the same axes (repeat; with --keys and --out, no RUN_DIR)")
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    if a.overlay:
        if a.run_dir or not a.out or a.keys == ",".join(DEFAULT_KEYS):
            ap.error("--overlay takes --keys and --out, and no RUN_DIR")
        print(plot_overlay(parse_overlay(a.overlay), a.keys.split(","), a.out, a.title))
        return
    if not a.run_dir:
        ap.error("give RUN_DIR, or --overlay")
    out = a.out or os.path.join(a.run_dir, "curves.png")
    recs = load(a.run_dir)
    sft = [f"sft/{k}" for k in SFT_KEYS]
    keys = eval_keys(recs) if a.eval_only else sft + a.keys.split(",") + eval_keys(recs)
    print(plot(recs, keys, out, os.path.basename(os.path.normpath(a.run_dir))))


if __name__ == "__main__":
    main()
