#!/usr/bin/env python
"""megaforge beside its peers: ratios per phase and pass@1 against wall-clock (issue 39 points 2 and 4).

    python tools/peers/compare.py mf.jsonl verl.jsonl trl.jsonl [eval.jsonl ...] [--png curves.png] [--json summary.jsonl]
        [--provenance '{"commit": "...", "device": "..."}']
    python tools/peers/compare.py --mcnemar eval_a_samples.jsonl.gz eval_b_samples.jsonl.gz

Reads schema lines (tools/peers/schema.py) of any systems. A run's label starts with its machine hold
(``hold1-mapped``: hold ``hold1``); each peer run is compared with the megaforge run of the same hold, so
every ratio is measured on one machine in one hold (a peer without megaforge in its hold gets no ratio).
Per run: median over the steps after the first (``first`` steps pay compilation and graph capture:
reported apart), of each phase; ratio = megaforge's median / the peer's median (below 1: megaforge is
faster; for tokens/s/GPU above 1 is better: the ratio printed is peer / megaforge then, so below 1
always means megaforge wins). Time to the peer's accuracy: the peer's greedy pass@1 at its last evaluated
step, and the training seconds (``train_wall_s``) each system needed to first reach it; where megaforge's
tools/evaluate.py grades do not reach it, its in-run grades give a ``cross_check/`` ratio, kept apart.

The PNG plots greedy pass@1 (eval records) against training seconds (running sum of step times; step 0
at 0 s; ``--with_startup`` adds each run's start-up), one line per system and run; a system's own in-run
evaluations (``megaforge-eval``, ``verl-val``) as hollow markers beside tools/evaluate.py's, as a cross-check.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schema import PHASES, SchemaError, median, read  # noqa: E402

HIGHER_IS_BETTER = {"tokens_per_s_per_gpu"}


def hold_of(run: str) -> str:
    return run.split("-")[0]


def load(paths: list[str]) -> dict:
    """{(system, run): {"steps": [...], "startup": rec or None, "evals": [...]}} of the files' records."""
    runs: dict = {}
    for p in paths:
        for r in read(p):
            d = runs.setdefault((r["system"], r["run"]), {"steps": [], "startup": None, "evals": []})
            if r["kind"] == "step":
                d["steps"].append(r)
            elif r["kind"] == "startup":
                d["startup"] = r
            else:
                d["evals"].append(r)
    for d in runs.values():
        d["steps"].sort(key=lambda r: r["step"])
        d["evals"].sort(key=lambda r: r["step"])
    return runs


def summary(d: dict) -> dict:
    """Medians of each phase over the steps after the first; the first step and start-up apart."""
    steps = d["steps"]
    rest = [r for r in steps if not r.get("first")] or steps
    out = {"steps": len(steps), "startup_s": d["startup"]["startup_s"] if d["startup"] else None,
           "first_step_s": steps[0]["step_s"] if steps else None}
    for k in PHASES:
        out[k] = median([r.get(k) for r in rest])
    return out


def wall_at(d: dict, step: int, with_startup: bool = False):
    """Training seconds at the end of ``step`` (0 at step 0); None when the run has no such step."""
    base = d["startup"]["startup_s"] if with_startup and d["startup"] else 0.0
    if step == 0:
        return base
    for r in d["steps"]:
        if r["step"] == step:
            return base + r["train_wall_s"] if r.get("train_wall_s") is not None else None
    return None


def curve(d: dict, with_startup: bool = False) -> list[tuple[float, float, int]]:
    """(seconds, pass@1, step) of the run's evaluations (tools/evaluate.py's when it has any)."""
    evals = [e for e in d["evals"] if e.get("source") == "tools/evaluate.py"] or d["evals"]
    pts = []
    for e in evals:
        t = wall_at(d, e["step"], with_startup)
        if t is not None:
            pts.append((t, e["pass1"], e["step"]))
    return sorted(pts)


def cross_checks(d: dict, with_startup: bool = False) -> dict:
    """{source: [(seconds, pass@1, step)]} of a run's own in-run evaluations when ``curve`` uses
    tools/evaluate.py's: plotted apart, never used for a ratio."""
    if not any(e.get("source") == "tools/evaluate.py" for e in d["evals"]):
        return {}
    out: dict = {}
    for e in d["evals"]:
        t = wall_at(d, e["step"], with_startup)
        if e.get("source") != "tools/evaluate.py" and t is not None:
            out.setdefault(e.get("source") or "in-run", []).append((t, e["pass1"], e["step"]))
    return {k: sorted(v) for k, v in out.items()}


def time_to(d: dict, target: float):
    """Training seconds at which the run's evaluations first reach pass@1 >= ``target`` (None: never)."""
    for t, p, _ in curve(d):
        if p >= target:
            return t
    return None


def compare(runs: dict) -> list[dict]:
    """One row per peer run: its summary, its hold's megaforge summary and the ratios."""
    rows = []
    mf = {hold_of(run): (run, d) for (system, run), d in runs.items() if system == "megaforge"}
    for (system, run), d in sorted(runs.items()):
        row = {"system": system, "run": run, "hold": hold_of(run), **summary(d)}
        if system != "megaforge" and row["hold"] in mf:
            mrun, md = mf[row["hold"]]
            ms = summary(md)
            row["megaforge_run"] = mrun
            for k in PHASES:
                a, b = ms.get(k), row.get(k)
                if k in HIGHER_IS_BETTER:
                    a, b = b, a
                row[f"ratio/{k}"] = a / b if a is not None and b else None
            pc = curve(d)
            if pc:
                target = pc[-1][1]
                tm, tp = time_to(md, target), time_to(d, target)
                row.update({"target_pass1": target, "target_step": pc[-1][2], "megaforge_s_to_target": tm,
                            "peer_s_to_target": tp, "ratio/time_to_target": tm / tp if tm is not None and tp else None})
                if tm is None:  # not reached by evaluate.py's grades: megaforge's own in-run ones, apart, as a cross-check
                    tc = next((t for pts in cross_checks(md).values() for t, p, _ in pts if p >= target), None)
                    row["cross_check/megaforge_s_to_target"] = tc
                    row["cross_check/ratio/time_to_target"] = tc / tp if tc is not None and tp else None
        rows.append(row)
    return rows


def greedy_correct(path: str) -> dict:
    """{prompt key: (prompt, correct)} of the greedy responses in a tools/evaluate.py ``--out`` file (``.jsonl`` or
    ``.jsonl.gz``) or a run's in-run evaluation file. The key is the row's source, ``where`` (file:line), when it has
    one: evaluate.py names the set after the file ("test") where a run names it after its config ("gsm8k_test");
    else (set, prompt_index)."""
    opener = gzip.open if path.endswith(".gz") else open
    out: dict = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                if r.get("mode", "greedy") == "greedy" and r.get("sample", 0) == 0:
                    out[r.get("where") or (r["set"], r["prompt_index"])] = (r["prompt"], bool(r["correct"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SchemaError(f"{path}:{n}: not an evaluate.py sample line ({type(e).__name__}: {e})") from None
    if not out:
        raise SchemaError(f"{path}: no greedy sample lines")
    return out


def mcnemar(a: dict, b: dict, a_name: str = "a", b_name: str = "b") -> dict:
    """Exact McNemar test of two systems' greedy correctness on the same prompts: with b01 prompts right
    only for ``a`` and b10 right only for ``b``, p = min(1, 2 * P[X <= min(b01, b10)]) for X ~ Binomial(b01 +
    b10, 1/2) (McNemar 1947; the exact binomial form, as statsmodels' ``mcnemar(exact=True)``)."""
    if a.keys() != b.keys():
        raise SchemaError(f"{a_name} and {b_name} graded different prompts: {len(a.keys() - b.keys())} only in "
                          f"{a_name}, {len(b.keys() - a.keys())} only in {b_name}")
    differ = [k for k in a if a[k][0] != b[k][0]]
    if differ:
        raise SchemaError(f"{a_name} and {b_name}: prompt {differ[0]} differs (set, prompt_index); "
                          f"{len(differ)} prompts differ in all")
    only_a = sum(1 for k in a if a[k][1] and not b[k][1])
    only_b = sum(1 for k in a if b[k][1] and not a[k][1])
    m = only_a + only_b
    tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1)) / 2 ** m if m else 1.0
    return {"a": a_name, "b": b_name, "prompts": len(a), "a_pass1": sum(v[1] for v in a.values()) / len(a),
            "b_pass1": sum(v[1] for v in b.values()) / len(b), "only_a": only_a, "only_b": only_b,
            "p_value": min(1.0, 2 * tail)}


def fmt(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}g}" if isinstance(x, float) else str(x)


def table(rows: list[dict]) -> str:
    cols = ["step_s", "rollout_s", "reward_s", "pi_old_s", "update_s", "train_s", "sync_s", "tokens_per_s_per_gpu"]
    out = ["| system | run | steps | start-up s | first step s | " + " | ".join(f"median {c}" for c in cols) + " |",
           "|" + "---|" * (5 + len(cols))]
    for r in rows:
        out.append(f"| {r['system']} | {r['run']} | {r['steps']} | {fmt(r['startup_s'])} | {fmt(r['first_step_s'])} | "
                   + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    peers = [r for r in rows if r["system"] != "megaforge"]
    if peers:
        out += ["", "| megaforge / peer | hold | " + " | ".join(cols) + " | time to peer's pass@1 |", "|" + "---|" * (3 + len(cols))]
        for r in peers:
            if "megaforge_run" not in r:
                out.append(f"| {r['system']} {r['run']} | {r['hold']} | no megaforge run in this hold |")
                continue
            tt = r.get("ratio/time_to_target")
            out.append(f"| {r['system']} {r['run']} | {r['hold']} | " + " | ".join(fmt(r.get(f"ratio/{c}")) for c in cols)
                       + f" | {fmt(tt)}" + (f" (pass@1 {r['target_pass1']:.4f} at step {r['target_step']})" if "target_pass1" in r else "")
                       + (f"; in-run cross-check: {fmt(r['cross_check/ratio/time_to_target'])}"
                          if r.get("cross_check/ratio/time_to_target") is not None else "")
                       + " |")
    return "\n".join(out)


def plot(runs: dict, path: str, with_startup: bool = False, gpu: str = "one GPU") -> int:
    """PNG of greedy pass@1 against training seconds on ``gpu`` (the title's words); the number of lines drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5.5))
    n = 0
    for (system, run), d in sorted(runs.items()):
        pts = curve(d, with_startup)
        if not pts:
            continue
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{system} ({run})")
        for t, p, s in pts:
            ax.annotate(str(s), (t, p), textcoords="offset points", xytext=(3, 3), fontsize=7)
        n += 1
        for source, cpts in cross_checks(d, with_startup).items():  # hollow: the system's own in-run evaluation
            ax.plot([p[0] for p in cpts], [p[1] for p in cpts], marker="o", linestyle="none", mfc="none",
                    color=line.get_color(), label=f"{system} ({run}), {source}: cross-check")
            for t, p, s in cpts:
                ax.annotate(str(s), (t, p), textcoords="offset points", xytext=(3, -9), fontsize=7)
    ax.set_xlabel("training seconds" + (" (with start-up)" if with_startup else " (sum of step times)"))
    ax.set_ylabel("GSM8K test greedy pass@1")
    ax.set_title(f"pass@1 against wall-clock, {gpu} (labels: step)")
    ax.grid(alpha=0.3)
    if n:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below the axes: no point hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*")
    p.add_argument("--mcnemar", nargs=2, metavar=("A", "B"),
                   help="two tools/evaluate.py --out files of the same prompts: the exact McNemar test, one JSON line")
    p.add_argument("--png")
    p.add_argument("--json", help="write one summary line per run here")
    p.add_argument("--with_startup", action="store_true")
    p.add_argument("--provenance", default="{}",
                   help="JSON object added to every summary line (commit, device, date, versions of the hold)")
    a = p.parse_args(argv)
    try:
        prov = json.loads(a.provenance)
    except json.JSONDecodeError as e:
        prov = e
    if not isinstance(prov, dict):
        print(f"megaforge: error: --provenance: not a JSON object: {a.provenance!r}", file=sys.stderr)
        return 2
    if not a.files and not a.mcnemar:
        p.error("give schema files, --mcnemar A B, or both")
    if a.mcnemar:
        try:
            x, y = a.mcnemar
            print(json.dumps(mcnemar(greedy_correct(x), greedy_correct(y), x, y)))
        except (SchemaError, OSError) as e:
            print(f"megaforge: error: {e}", file=sys.stderr)
            return 2
        if not a.files:
            return 0
    try:
        runs = load(a.files)
    except (SchemaError, OSError) as e:
        print(f"megaforge: error: {e}", file=sys.stderr)
        return 2
    rows = compare(runs)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "provenance": prov} if prov else r) + "\n")
    if a.png:
        n = plot(runs, a.png, a.with_startup, gpu=prov.get("device") or "one GPU")
        print(f"[compare] {a.png}: {n} curves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
