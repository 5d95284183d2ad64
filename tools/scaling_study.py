"""Scaling study: run (or submit) a sweep of layouts, collect each run's metrics, write the table
(CSV + Markdown), PNG plots (throughput, step-time breakdown, scaling efficiency, cost model) and the
cost model's fit, leave-one-out check and projection to 64-1024 GPUs (formulas: tools/scaling_model.py).

    python tools/scaling_study.py tools/scaling/cpu_demo.yaml --out runs/scaling_cpu           # run here
    python tools/scaling_study.py SPEC.yaml --out DIR --via slurm --slurm_args "--partition P --account A --time 00:30:00"
    python tools/scaling_study.py SPEC.yaml --out DIR --collect_only     # tables and plots of finished runs
    python tools/scaling_study.py SPEC.yaml --out DIR --plan_only        # the dry-run verdict of every point

The spec (YAML)::

    name: cpu_demo
    launcher: grpo                       # or sft
    config: configs/demo_cpu.yaml
    args: [--max_steps, 4, ...]          # config overrides shared by every point
    model_config: ""                     # for the dry run / cost model when model.path is a hub id
    warmup_steps: 1                      # first steps left out of the means (when more steps exist)
    timeout_s: 600                       # per point
    gpus_per_node: 8                     # nodes = ceil(gpus / gpus_per_node)
    gpu: H200                            # the dry run's GPU
    sweep: {gpus: [1, 2], tp: [1], pp: [1], cp: [1], engines: [1], engine_tp: [1], rollout_gpus: [0]}
    points: [{gpus: 8, rollout_gpus: 4, engines: 4}]     # explicit points, added to the sweep
    hardware: {preset: h200}             # cost model constants (scaling_model.HARDWARE), overridable
    projection: {gpus: [64, 128, 256, 512, 1024], batch: weak, reference: ""}

A point is ``gpus`` GPUs (CPU: gloo processes) with TP/PP/CP ``tp/pp/cp``, ``engines`` rollout engines
of TP ``engine_tp`` and ``rollout_gpus`` GPUs of their own (0: colocated); it runs as
``torchrun --nproc_per_node gpus-rollout_gpus launchers/<launcher>.py --config ... <args>
--trainer.tensor_parallel tp ... --rollout.num_engines engines ...`` in ``<out>/runs/<name>`` (one node;
``--via slurm``/``local`` submits it through launchers/slurm.py instead; ``--runs_dir`` puts the run
directories elsewhere; a finished point's checkpoints are deleted unless ``--keep_checkpoints``).
Points the dry run rejects are listed with the reason and not run. Scaling efficiency = (tokens/s per
GPU) / (tokens/s per GPU of the point with the fewest GPUs); speedup = tokens/s / tokens/s of that
point. Tokens per step = throughput/tokens_per_s x time/step (the trained batch: prompts + responses).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time

import scaling_model as cm
from common import ROOT

AXES = {"gpus": 1, "tp": 1, "pp": 1, "cp": 1, "engines": 1, "engine_tp": 1, "rollout_gpus": 0}
PHASE_KEYS = {"rollout": "time/rollout", "train": "time/train", "sync": "time/sync", "offload": "time/offload",
              "onload": "time/onload"}
COLUMNS = ["name", "status", "gpus", "nodes", "trainer_ranks", "tp", "pp", "cp", "dp", "engine", "engines",
           "engines_running", "engine_tp",
           "rollout_gpus", "colocated", "steps_measured", "time_step_s", "time_rollout_s", "time_train_s", "time_sync_s",
           "time_offload_s", "time_onload_s", "time_other_s", "tokens_per_step", "gen_tokens_per_step", "tokens_per_s",
           "tokens_per_s_per_gpu", "speedup", "scaling_efficiency", "reason"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------------------------------ points
def load_spec(path: str) -> dict:
    import yaml

    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    for key in ("config",):
        if key not in spec:
            raise SystemExit(f"{path}: the spec needs '{key}'")
    spec.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    spec.setdefault("launcher", "grpo")
    return spec


def expand(spec: dict) -> list[dict]:
    pts, seen = [], set()
    sweep = spec.get("sweep") or {}
    if sweep:
        bad = set(sweep) - set(AXES)
        if bad:
            raise SystemExit(f"sweep: unknown axes {sorted(bad)} (valid: {list(AXES)})")
        axes = {k: list(sweep.get(k, [v])) for k, v in AXES.items()}
        for combo in itertools.product(*axes.values()):
            pts.append(dict(zip(axes, combo)))
    for p in spec.get("points") or []:
        pts.append({**AXES, **p})
    out = []
    for p in pts:
        key = tuple(sorted((k, str(v)) for k, v in p.items()))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def point_name(p: dict) -> str:
    name = f"g{p['gpus']}_tp{p['tp']}_pp{p['pp']}_cp{p['cp']}_e{p['engines']}"
    name += f"x{p['engine_tp']}" if p["engine_tp"] != 1 else ""
    name += f"_r{p['rollout_gpus']}" if p["rollout_gpus"] else ""
    return name + (f"_{p['tag']}" if p.get("tag") else "")


def nodes_of(spec: dict, p: dict) -> tuple[int, int]:
    gpn = int(spec.get("gpus_per_node", 8))
    nodes = max(1, math.ceil(p["gpus"] / gpn))
    return nodes, p["gpus"] // nodes


def point_argv(spec: dict, p: dict, runs: str) -> list[str]:
    argv = ["--config", spec["config"], *[str(a) for a in spec.get("args", [])],
            "--trainer.tensor_parallel", str(p["tp"]), "--trainer.pipeline_parallel", str(p["pp"]),
            "--trainer.context_parallel", str(p["cp"]), "--rollout.num_engines", str(p["engines"]),
            "--rollout.tensor_parallel", str(p["engine_tp"]), "--rollout.num_gpus", str(p["rollout_gpus"]),
            *[str(a) for a in p.get("args", [])]]
    return argv + ["--output_dir", runs, "--run_name", point_name(p)]


def plan_point(spec: dict, p: dict, argv: list[str]) -> dict:
    """The dry run's plan of the point (megaforge.planner), in process."""
    from megaforge.build import RunBuilder
    from megaforge.config import load_config
    from megaforge.configtree import ConfigError
    from megaforge.planner import make_plan

    try:
        cfg = load_config(argv)
    except ConfigError as e:
        return {"ok": False, "errors": [{"message": str(e)}]}
    nodes, gpn = nodes_of(spec, p)
    opts = {"nodes": nodes, "gpus_per_node": gpn, "model_config": spec.get("model_config", "")}
    if spec.get("gpu"):
        opts["gpu"] = spec["gpu"]
    plan = make_plan(RunBuilder(cfg).plan_input(), spec["launcher"], opts)
    plan["_cfg"] = cfg
    return plan


# ------------------------------------------------------------------------------------------ running
def _visible(n: int) -> str:
    have = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in have.split(",") if x.strip()] if have else [str(i) for i in range(max(n, 1))]
    return ",".join(ids[:n])


def run_local(spec: dict, p: dict, argv: list[str], log_path: str) -> str:
    nodes, _ = nodes_of(spec, p)
    if nodes > 1:
        return f"skipped: {p['gpus']} GPUs need {nodes} nodes (use --via slurm)"
    nproc = p["gpus"] - p["rollout_gpus"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(ROOT, "launchers", f"{spec['launcher']}.py"), *argv]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES=_visible(p["gpus"]))
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=float(spec.get("timeout_s", 600)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return f"failed: over timeout_s={spec.get('timeout_s', 600)}"
    return "ok" if rc == 0 else f"failed: exit {rc} after {time.time() - t0:.0f} s (see {os.path.relpath(log_path)})"


def submit(spec: dict, p: dict, argv: list[str], via: str, slurm_args: list[str]) -> str:
    from megaforge import slurm

    nodes, gpn = nodes_of(spec, p)
    job, _, _ = slurm.submit(["--cluster", via, "--nodes", str(nodes), "--gpus_per_node", str(gpn),
                                     "--launcher", spec["launcher"], *slurm_args, *argv])
    if via == "local":
        job.result()
        return "ok"
    return f"submitted: job {job.job_id}"


# ---------------------------------------------------------------------------------------- collecting
def collect(spec: dict, p: dict, plan: dict, run_dir: str) -> dict:
    row = {"name": point_name(p), **{k: p[k] for k in AXES}, "colocated": p["rollout_gpus"] == 0}
    nodes, _ = nodes_of(spec, p)
    lay = plan.get("layout") or {}
    row.update(nodes=nodes, trainer_ranks=p["gpus"] - p["rollout_gpus"], dp=lay.get("dp", ""), engine=lay.get("engine", ""),
               engines_running=lay.get("num_engines", ""))  # the embedded engine is one, in rank 0
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return row
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    warm = int(spec.get("warmup_steps", 1))
    use = recs[warm:] if len(recs) > warm else recs
    if not use:
        return row
    mean = lambda key: sum(float(r.get(key) or 0.0) for r in use) / len(use)  # noqa: E731
    row["steps_measured"] = len(use)
    row["time_step_s"] = mean("time/step")
    for ph, key in PHASE_KEYS.items():
        row[f"time_{ph}_s"] = mean(key)
    row["time_other_s"] = max(0.0, row["time_step_s"] - sum(row[f"time_{ph}_s"] for ph in PHASE_KEYS))
    row["tokens_per_step"] = sum(float(r["throughput/tokens_per_s"]) * float(r["time/step"]) for r in use) / len(use)
    cfg = plan.get("_cfg")
    seqs = cfg.rollout.batch_size * cfg.grpo.n_samples if cfg is not None else 0
    row["gen_tokens_per_step"] = mean("response_len/mean") * seqs
    row["tokens_per_s"] = row["tokens_per_step"] / row["time_step_s"]
    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / p["gpus"]
    return row


def add_efficiency(rows: list[dict]) -> None:
    done = [r for r in rows if r.get("tokens_per_s")]
    if not done:
        return
    base = min(done, key=lambda r: r["gpus"])
    for r in done:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_table(rows: list[dict], path: str, columns: list[str]) -> None:
    with open(path + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in columns})
    with open(path + ".md", "w") as f:
        f.write("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n")
        for r in rows:
            f.write("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |\n")


# ------------------------------------------------------------------------------------------- plots
def plots(rows: list[dict], loo: list[dict], proj: list[dict], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = sorted([r for r in rows if r.get("tokens_per_s")], key=lambda r: (r["gpus"], r["name"]))
    files = []
    family = lambda r: f"tp{r['tp']} pp{r['pp']} cp{r['cp']} " + ("colocated" if r["colocated"] else "disaggregated")  # noqa: E731
    fams = sorted({family(r) for r in done})
    base = min(done, key=lambda r: r["gpus"]) if done else None

    fig, ax = plt.subplots(figsize=(6, 4))
    for fam in fams:
        pts = [r for r in done if family(r) == fam]
        ax.plot([r["gpus"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", label=fam)
    if base:
        xs = sorted({r["gpus"] for r in done})
        ax.plot(xs, [base["tokens_per_s"] * x / base["gpus"] for x in xs], "k--", lw=0.8, label="ideal (linear)")
    ax.set(xlabel="GPUs (CPU: gloo processes)", ylabel="tokens / s", title="Throughput")
    ax.legend(fontsize=7)
    files.append(_save(fig, out, "throughput.png"))

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(done) + 2), 4))
    bottom = [0.0] * len(done)
    for ph in ("rollout", "train", "sync", "offload", "onload", "other"):
        vals = [r.get(f"time_{ph}_s", 0.0) or 0.0 for r in done]
        ax.bar(range(len(done)), vals, bottom=bottom, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(done)), [r["name"] for r in done], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="seconds per step", title="Step-time breakdown")
    ax.legend(fontsize=7)
    files.append(_save(fig, out, "step_breakdown.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for fam in fams:
        pts = [r for r in done if family(r) == fam]
        ax.plot([r["gpus"] for r in pts], [r["scaling_efficiency"] for r in pts], "o-", label=fam)
    if proj:
        ax.plot([r["gpus"] for r in proj], [r["scaling_efficiency"] for r in proj], "s:", label="cost model projection")
        ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set(xlabel="GPUs", ylabel="efficiency (tokens/s per GPU vs smallest run)", title="Scaling efficiency")
    ax.legend(fontsize=7)
    files.append(_save(fig, out, "scaling_efficiency.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["gpus"] for r in done], [r["time_step_s"] for r in done], "o", label="measured")
    if loo:
        ax.plot([r["gpus"] for r in loo], [r["predicted_step_s"] for r in loo], "x", ms=9, label="predicted (leave-one-out)")
    if proj:
        ax.plot([r["gpus"] for r in proj], [r["step_s"] for r in proj], "s:", label=f"projected ({proj[0]['batch']} scaling)")
        ax.set_xscale("log", base=2)
    ax.set(xlabel="GPUs", ylabel="seconds per step", title="Cost model")
    ax.legend(fontsize=7)
    files.append(_save(fig, out, "cost_model.png"))
    return files


def _save(fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------- cost model
def cost_model(spec: dict, rows: list[dict], plans: dict, out: str) -> tuple[list[dict], list[dict], dict]:
    """Fit on the measured points, leave-one-out errors, projection; writes cost_model.md/csv and
    projection.csv/md. Returns (loo rows, projection rows, fitted coefficients)."""
    from megaforge.planner.shapes import read_shape

    done = [r for r in rows if r.get("tokens_per_s")]
    if not done:
        return [], [], {}
    cfg = plans[done[0]["name"]]["_cfg"]
    shape = cm.shape_from_planner(read_shape(cfg.model, spec.get("model_config", "")), DTYPE_BYTES[cfg.model.dtype])
    hw = cm.Hardware.make(spec.get("hardware") or {"preset": "h200"})
    pts = []
    for r in done:
        plan = plans[r["name"]]
        meas = {"rollout": r["time_rollout_s"], "train": r["time_train_s"], "sync": r["time_sync_s"],
                "offload_onload": r["time_offload_s"] + r["time_onload_s"], "other": r["time_other_s"], "step": r["time_step_s"]}
        pts.append(cm.Point(r["gpus"], r["tp"], r["pp"], r["cp"], r["engines_running"] or 1, r["engine_tp"], r["rollout_gpus"],
                            plan.get("micro_batch", {}).get("micro_batches_per_step", 1), r["tokens_per_step"],
                            r["gen_tokens_per_step"], meas, r["name"], fixed_engines=r["engine"] == "embedded"))
    model = cm.fit(pts, shape, hw)
    loo = cm.leave_one_out(pts, shape, hw)
    pj = spec.get("projection") or {}
    ref_name = pj.get("reference") or max(pts, key=lambda p: (p.gpus, p.name)).name
    ref = next(p for p in pts if p.name == ref_name)
    base = min(pts, key=lambda p: p.gpus)
    proj = cm.projections(model, ref, base, list(pj.get("gpus", [64, 128, 256, 512, 1024])), pj.get("batch", "weak"))
    write_table(loo, os.path.join(out, "cost_model_loo"), list(loo[0]) if loo else ["name"])
    write_table(proj, os.path.join(out, "projection"), list(proj[0]) if proj else ["gpus"])
    coef = {ph: {"c0": c[0], "c1": c[1]} for ph, c in model.coef.items()}
    with open(os.path.join(out, "cost_model.md"), "w") as f:
        f.write(f"# Cost model ({spec['name']})\n\nFormulas: tools/scaling_model.py. Hardware: {vars(hw)}.\n"
                f"Model: {shape.params / 1e9:.3f} B params ({shape.active_params / 1e9:.3f} B active), {shape.layers} layers, "
                f"hidden {shape.hidden}, {shape.bytes_per_el} B/element.\n\n## Fitted on all {len(pts)} measured point(s)\n\n")
        f.write("| phase | c0 (s) | c1 (s per unit) |\n|---|---|---|\n")
        for ph, c in coef.items():
            f.write(f"| {ph} | {c['c0']:.4g} | {c['c1']:.4g} |\n")
        f.write("\n## Leave-one-out: each point predicted by a fit on the others\n\n")
        f.write(open(os.path.join(out, "cost_model_loo.md")).read() if loo else "(one measured point: nothing to hold out)\n")
        f.write(f"\n## Projection from {ref.name} ({pj.get('batch', 'weak')} scaling)\n\n")
        f.write(open(os.path.join(out, "projection.md")).read())
    return loo, proj, coef


# ------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--out", required=True)
    ap.add_argument("--via", choices=("torchrun", "local", "slurm"), default="torchrun",
                    help="torchrun here (one node), or launchers/slurm.py (local executor / SLURM)")
    ap.add_argument("--slurm_args", default="", help="launchers/slurm.py flags for --via slurm|local (quoted)")
    ap.add_argument("--collect_only", action="store_true")
    ap.add_argument("--plan_only", action="store_true")
    ap.add_argument("--rerun", action="store_true", help="run points whose run directory already has metrics again")
    ap.add_argument("--runs_dir", default="", help="where the points' run directories go (default <out>/runs)")
    ap.add_argument("--keep_checkpoints", action="store_true", help="keep each finished point's checkpoints (default: deleted)")
    a = ap.parse_args(argv)
    spec = load_spec(a.spec)
    out = os.path.abspath(a.out)
    runs = os.path.abspath(a.runs_dir or os.path.join(out, "runs"))
    os.makedirs(runs, exist_ok=True)
    rows, plans = [], {}
    for p in expand(spec):
        name = point_name(p)
        argv_p = point_argv(spec, p, runs)
        plan = plans[name] = plan_point(spec, p, argv_p)
        run_dir = os.path.join(runs, name)
        if not plan.get("ok"):
            reason = "; ".join(e["message"] for e in plan.get("errors", [])) or "a phase does not fit in GPU memory"
            rows.append({"name": name, **p, "status": "skipped", "reason": f"dry run: {reason}"})
            print(f"[study] {name}: skipped ({reason})", flush=True)
            continue
        status = "planned"
        if not a.plan_only:
            have = os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
            if a.collect_only or (have and not a.rerun):
                status = "ok" if have else "not run"
            else:
                if have:
                    import shutil

                    shutil.rmtree(run_dir)
                print(f"[study] {name}: running ({a.via})", flush=True)
                status = run_local(spec, p, argv_p, os.path.join(runs, name + ".log")) if a.via == "torchrun" \
                    else submit(spec, p, argv_p, a.via, shlex.split(a.slurm_args))
                if not a.keep_checkpoints and status == "ok":
                    import shutil

                    for sub in ("checkpoints", "hf"):  # the study needs metrics and logs, not weights
                        shutil.rmtree(os.path.join(run_dir, sub), ignore_errors=True)
        row = collect(spec, p, plan, run_dir)
        row["status"] = status if not status.startswith("ok") or row.get("tokens_per_s") else "ok (no metrics)"
        rows.append(row)
        print(f"[study] {name}: {row['status']}" + (f", {row['time_step_s']:.3f} s/step, {row['tokens_per_s']:.1f} tokens/s"
                                                   if row.get("tokens_per_s") else ""), flush=True)
    add_efficiency(rows)
    write_table(rows, os.path.join(out, "scaling"), COLUMNS)
    loo, proj, coef = cost_model(spec, rows, plans, out)
    files = []
    if any(r.get("tokens_per_s") for r in rows):
        try:
            files = plots(rows, loo, proj, out)
        except ImportError as e:  # tables are written; plot later with --collect_only where matplotlib is
            print(f"[study] no plots: {e} (pip install matplotlib, then --collect_only)", flush=True)
    with open(os.path.join(out, "study.json"), "w") as f:
        json.dump({"spec": spec, "rows": rows, "cost_model": {"coefficients": coef, "leave_one_out": loo, "projection": proj},
                   "plots": files}, f, indent=1, default=str)
    print(f"[study] table: {out}/scaling.csv, scaling.md; cost model: {out}/cost_model.md; plots: "
          f"{', '.join(os.path.basename(x) for x in files) or 'none (no measured point)'}", flush=True)
    for r in loo:
        print(f"[study] cost model: {r['name']} measured {r['measured_step_s']:.4g} s/step, predicted from "
              f"{r['fit_on']} {r['predicted_step_s']:.4g} s ({100 * r['rel_error']:+.1f}%)", flush=True)
    return 0 if all(not str(r.get("status", "")).startswith("failed") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
