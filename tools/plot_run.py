"""Plot a run's curves to PNG.

    python tools/plot_run.py RUN_DIR [--out FILE.png] [--keys reward/mean,loss,...]

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per step) and writes a grid of line plots, one
per metric, to ``RUN_DIR/curves.png`` by default.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEFAULT_KEYS = ["reward/mean", "loss", "kl", "entropy", "clip_frac", "response_len/mean",
                "train_rollout_logprob_abs_diff", "time/step", "throughput/tokens_per_s"]


def load(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"plot_run: {path} does not exist")
    recs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"plot_run: {path}:{i} is not valid JSON; skipped", file=sys.stderr)
    if not recs:
        raise SystemExit(f"plot_run: {path} holds no records")
    return recs


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
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5)
        ax.set_title(k, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keys", default=",".join(DEFAULT_KEYS))
    a = ap.parse_args(argv)
    out = a.out or os.path.join(a.run_dir, "curves.png")
    print(plot(load(a.run_dir), a.keys.split(","), out, os.path.basename(os.path.normpath(a.run_dir))))


if __name__ == "__main__":
    main()
