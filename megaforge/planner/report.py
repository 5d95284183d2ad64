"""The dry run: build the plan (checks, placement, memory per phase), print it, write its JSON.

Exit status: 0 the plan fits, 1 a layout that cannot work (every broken constraint printed with its
config key), 3 a phase that does not fit in the GPU's memory (with the knobs that would make it fit).
The last line of stdout is the plan as one JSON object (also written to ``--dry_run_json FILE``).
"""
from __future__ import annotations

import json
import sys

from megaforge.configtree import flag_value
from megaforge.planner import memory as M
from megaforge.planner.layout import Hardware, check_layout, default_gpus, placement, resolve_gpu
from megaforge.planner.phases import NOFIT, estimate, knobs
from megaforge.planner.shapes import ShapeError, read_shape, read_teacher_shape
from megaforge.specs import PlanInput, expect

#: launcher flags of the dry run (not config keys): name -> type (bool: no value)
FLAGS = {"dry_run": bool, "dry_run_json": str, "model_config": str, "teacher_config": str, "nodes": int,
         "gpus_per_node": int, "gpu": str, "gpu_memory_gib": float, "reserve_gib": float}
EXIT_OK, EXIT_LAYOUT, EXIT_NOFIT = 0, 1, 3


class FlagError(ValueError):
    pass


def split_argv(argv: list[str]) -> tuple[dict, list[str]]:
    """Take the dry-run flags (``--dry_run``, ``--nodes 2``, ``--gpu=H200`` ...) out of ``argv``;
    returns ({flag: value}, the remaining config arguments)."""
    opts, rest, i = {}, [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, val = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        name = name.replace("-", "_")
        if name not in FLAGS:
            rest.append(arg)
            i += 1
            continue
        kind = FLAGS[name]
        val, i = flag_value(argv, i, name, eq, val, kind is bool, FlagError)
        if kind is bool:
            opts[name] = val
        else:
            try:
                opts[name] = kind(val)
            except ValueError:
                raise FlagError(f"--{name} {val!r}: expected {kind.__name__}") from None
        i += 1
    extra = sorted(k for k in opts if k != "dry_run")
    if extra and not opts.get("dry_run"):
        raise FlagError(f"--{extra[0]} only applies to a dry run: add --dry_run")
    return opts, rest


def _gib(x: float) -> float:
    return round(x / M.GiB, 3)


def make_plan(pin: PlanInput, mode: str, opts: dict) -> dict:
    """The plan of ``pin`` (:meth:`megaforge.build.RunBuilder.plan_input`) as a JSON-ready dict (see
    module docstring for ``exit_code``)."""
    expect(pin, PlanInput, "make_plan")
    plan = {"launcher": mode, "ok": False, "exit_code": EXIT_LAYOUT, "errors": [], "warnings": []}
    try:
        shape = read_shape(pin.model, opts.get("model_config", ""))
    except ShapeError as e:
        plan["errors"].append({"key": "model", "message": str(e)})
        return plan
    teacher, teacher_warns = None, []
    try:
        teacher = _teacher(pin, shape, mode, opts.get("teacher_config", ""), plan, teacher_warns)
    except ShapeError as e:
        plan["errors"].append({"key": "teacher.path", "message": str(e)})
        return plan
    gpu, mem = resolve_gpu(opts.get("gpu"), opts.get("gpu_memory_gib"))
    assumed = []
    if "gpus_per_node" not in opts:
        assumed.append("gpus_per_node: the smallest count that holds one trainer replica (give --gpus_per_node)")
    if "gpu" not in opts and "gpu_memory_gib" not in opts:
        assumed.append("GPU memory 80 GiB (give --gpu NAME or --gpu_memory_gib)")
    hw = Hardware(opts.get("nodes", 1), opts.get("gpus_per_node", default_gpus(pin)), gpu, mem, assumed)
    plan["model"] = shape.as_dict()
    plan["hardware"] = {"nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node, "gpu": hw.gpu,
                        "memory_gib": hw.memory_gib, "assumed": assumed}
    if pin.memory.offload == "auto":
        resolved, why = decide_offload(pin, mode, {**opts, "gpu": hw.gpu, "gpu_memory_gib": hw.memory_gib,
                                                   "nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node})
        plan["memory_offload"] = {"auto": resolved, "reason": why}
        pin = pin.vary({"memory.offload": resolved})
    lay, errs, warns = check_layout(pin, shape, hw, mode)
    plan["warnings"] = teacher_warns + warns
    plan["errors"] = [{"key": e.key, "message": str(e)} for e in errs]
    if lay is None:
        return plan
    plan["model"]["padded_vocab"] = shape.padded_vocab(lay.tp) if lay.backend == "megatron" else shape.vocab
    plan["layout"] = dict(vars(lay))
    plan["placement"] = placement(lay, hw)
    reserve = opts.get("reserve_gib", 2.0)
    phases, kv = estimate(pin, shape, lay, hw, mode, reserve, teacher)
    seq, rows, nm = M.micro_batches(pin, lay, mode if mode == "sft" else ("grpo" if pin.max_steps else "sft"))
    seq_pad = -(-seq // (2 * lay.cp)) * 2 * lay.cp if lay.cp > 1 else seq
    plan["micro_batch"] = {"seq_len": seq, "rows": rows, "micro_batches_per_step": nm,
                           "tokens_per_rank": int(rows * seq_pad / lay.cp)}
    plan["kv"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in kv.items()}
    plan["phases"] = {}
    for ph in phases:
        entry = {"items": {i.name: _gib(i.bytes) for i in ph.items}, "notes": {i.name: i.note for i in ph.items if i.note},
                 "allocated_gib": _gib(ph.allocated), "trainer_allocated_gib": _gib(ph.owned("trainer")),
                 "engine_allocated_gib": _gib(ph.owned("engine")), "reserve_gib": _gib(ph.reserve),
                 "total_gib": _gib(ph.total), "verdict": ph.verdict, "where": ph.where, "problem": ph.problem}
        if ph.verdict != "fits":
            entry["knobs"] = knobs(pin, shape, hw, mode, ph, reserve, teacher=teacher)
        plan["phases"][ph.name] = entry
    nofit = any(p.verdict == NOFIT for p in phases)
    plan["ok"] = not nofit
    plan["exit_code"] = EXIT_NOFIT if nofit else EXIT_OK
    return plan


def _teacher(pin: PlanInput, shape, mode: str, override: str, plan: dict, warns: list):
    """The distillation teacher's shape for the estimate (None: none on these GPUs, or not known here, said
    in ``warns``); its facts into ``plan["teacher"]``. ShapeError: a vocabulary the run would refuse, or
    ``--teacher_config`` without a teacher or unreadable."""
    t = pin.teacher
    if not t.path:
        if override:
            raise ShapeError(f"--teacher_config {override!r}: the config has no teacher (teacher.path is empty)")
        return None
    if mode != "grpo":
        return None
    if t.served_by == "engine" and t.url:
        plan["teacher"] = {"served_by": "engine", "url": t.url, "counted": False}
        return None
    tshape = read_teacher_shape(t, override)
    if tshape is None:
        warns.append(f"the teacher's memory is not counted: teacher.path {t.path!r} is no HF model folder here (a run "
                     "folder, or a path on the GPU machine): give --teacher_config configs/models/<name>")
        plan["teacher"] = {"served_by": t.served_by, "counted": False}
        return None
    if tshape.vocab != shape.vocab:  # megaforge.trainer.teacher.check_vocabulary refuses it at start-up
        raise ShapeError(f"the teacher ({tshape.source}) has a vocabulary of {tshape.vocab} rows, the student's "
                         f"{shape.vocab}: distillation compares their log-probs of the same token ids")
    plan["teacher"] = {**tshape.as_dict(), "served_by": t.served_by, "counted": True}
    return tshape


def decide_offload(pin: PlanInput, mode: str, opts: dict) -> tuple[str, str]:
    """(``memory.offload`` for ``auto``, why): ``none`` when the engines have GPUs of their own or the
    phases the offload changes (``rollout`` and ``sync``: the trainer state left beside the engine) fit in
    :func:`make_plan` with the state resident (``opts``: the GPU and the job's nodes x GPUs), else
    ``pinned`` (also when the planner cannot estimate the run: the choice that needs the least GPU
    memory, with the planner's error in the reason). The train phase holds the whole state either way."""
    resident = pin.vary({"memory.offload": "none"})
    plan = make_plan(resident, mode, opts) if resident is not None else {"errors": [{"message": "config refused"}]}
    phases = plan.get("phases")
    if not phases:
        errs = "; ".join(e["message"] for e in plan["errors"]) or "no phase estimated"
        return "pinned", f"the planner could not estimate the run with the trainer state resident ({errs})"
    if not plan["layout"]["colocated"]:
        return "none", "the engines run on GPUs of their own: nothing shares the trainer's GPUs"
    mem = plan["hardware"]["memory_gib"]
    shared = {n: p for n, p in phases.items() if n in ("rollout", "sync")}
    bad = [(n, p) for n, p in shared.items() if p["verdict"] != "fits"]
    if bad:
        n, p = bad[0]
        return "pinned", (f"with the trainer state resident the {n} phase would need {p['total_gib']:.1f} of "
                          f"{mem:.1f} GiB ({p['verdict']}; planner)")
    n, p = max(shared.items(), key=lambda kv: kv[1]["total_gib"])
    return "none", (f"the rollout and sync phases fit with the trainer state resident (the larger, {n}: "
                    f"{p['total_gib']:.1f} of {mem:.1f} GiB; planner)")


# --------------------------------------------------------------------------------------- printing
def _coords(c: dict) -> str:
    keys = ("tp", "cp", "dp", "pp", "ep")
    return " ".join(f"{k}{c[k]}" for k in keys if k in c)


def format_plan(plan: dict, config_path: str = "") -> str:
    out = [f"megaforge dry run ({plan['launcher']} launcher{', ' + config_path if config_path else ''}): "
           "no run directory, no weights, no processes"]
    m = plan.get("model")
    if m:
        moe = f", MoE {m['experts']} experts top-{m['topk']} ffn {m['expert_ffn']}" if m["experts"] else ""
        out.append(f"model     {m['model_type']} from {m['source']}: {m['layers']} layers, hidden {m['hidden']}, heads "
                   f"{m['heads']}/{m['kv_heads']} kv x {m['head_dim']}, ffn {m['ffn']}{moe}, vocab {m['vocab']}"
                   + (f" (padded {m['padded_vocab']})" if m.get("padded_vocab") else "")
                   + f", {'tied' if m['tied'] else 'untied'}; {m['hf_params'] / 1e9:.3f} B params")
    t = plan.get("teacher")
    if t:
        if t.get("url"):
            out.append(f"teacher   served by the SGLang server at {t['url']} (teacher.url): no memory here")
        elif not t["counted"]:
            out.append(f"teacher   served by the {t['served_by']}: not counted (see the warning)")
        else:
            out.append(f"teacher   {t['model_type']} from {t['source']}: {t['layers']} layers, hidden {t['hidden']}, ffn "
                       f"{t['ffn']}, vocab {t['vocab']}; {t['hf_params'] / 1e9:.3f} B params, served by the {t['served_by']}")
    hw = plan.get("hardware")
    if hw:
        out.append(f"hardware  {hw['nodes']} node(s) x {hw['gpus_per_node']} GPUs, {hw['gpu']} {hw['memory_gib']:.1f} GiB each")
        out += [f"          assumed: {a}" for a in hw["assumed"]]
    if plan.get("memory_offload"):
        out.append(f"memory    memory.offload auto -> {plan['memory_offload']['auto']}: {plan['memory_offload']['reason']}")
    lay = plan.get("layout")
    if lay:
        tr = (f"trainer   {lay['backend']}: {lay['world']} ranks = TP {lay['tp']} x CP {lay['cp']} x PP {lay['pp']} x DP {lay['dp']}"
              + (f"; experts EP {lay['ep']} x expert-TP {lay['etp']} x EDP {lay['edp']}" if lay["ep"] > 1 else "")
              + (", sequence parallel" if lay["sp"] else "") + f", layer spec {lay['spec']}")
        out.append(tr)
        if lay["engine"]:
            where = "colocated" if lay["colocated"] else f"on {lay['rollout_gpus']} GPUs of their own"
            out.append(f"rollout   {lay['engine']}: {lay['num_engines']} engine(s) x TP {lay['engine_tp']}, {where}")
        mb = plan["micro_batch"]
        out.append(f"batches   sequences of up to {mb['seq_len']} tokens, {mb['rows']} per micro-batch "
                   f"({mb['tokens_per_rank']} tokens per rank), {mb['micro_batches_per_step']} micro-batch(es) per optimizer step")
    for w in plan["warnings"]:
        out.append(f"warning   {w}")
    for e in plan["errors"]:
        out.append(f"ERROR     {e['message']}")
    if plan.get("placement"):
        out.append("placement")
        rows = plan["placement"]
        shown = rows if len(rows) <= 64 else [r for r in rows if r["node"] in (0, rows[-1]["node"])]
        for r in shown:
            parts = []
            if "trainer" in r:
                parts.append(f"trainer rank {r['trainer']['rank']:>3} ({_coords(r['trainer'])})")
            if "engine" in r:
                e = r["engine"]
                parts.append(f"engine {e['id']} TP rank {e['tp_rank']}" + (" (in the rank-0 process)" if e.get("in_process") else ""))
            out.append(f"  node {r['node']} GPU {r['gpu']}: " + (" | ".join(parts) or "idle"))
        if len(shown) < len(rows):
            out.append(f"  ... ({len(rows) - len(shown)} more GPUs laid out the same way)")
    if plan.get("phases"):
        out.append(f"memory per GPU (GiB of {plan['hardware']['memory_gib']:.1f}; formulas: megaforge/planner/memory.py)")
        for name, ph in plan["phases"].items():
            out.append(f"  {name} phase" + (f" [{ph['where']}]" if ph["where"] else ""))
            for item, gib in ph["items"].items():
                note = ph["notes"].get(item, "")
                out.append(f"    {item:<48} {gib:9.2f}" + (f"   {note}" if note else ""))
            out.append(f"    {'runtime reserve (CUDA context, NCCL, allocator)':<48} {ph['reserve_gib']:9.2f}")
            out.append(f"    {'total':<48} {ph['total_gib']:9.2f}   -> {ph['verdict'].upper()}")
            if ph["problem"]:
                out.append(f"    problem: {ph['problem']}")
            for k in ph.get("knobs", []):
                out.append(f"    knob: {k['change']} -> {k['gib']:.2f} GiB")
            if ph["verdict"] != "fits" and not ph.get("knobs"):
                out.append("    knob: no single config change makes it fit; add GPUs (--nodes) or combine the knobs above")
        kv = plan.get("kv") or {}
        if kv.get("capacity_tokens") is not None:
            held = kv["capacity_tokens"] / max(kv["sequence_tokens"], 1)
            out.append(f"  KV cache per engine: {kv['kv_gib']:.2f} GiB = {kv['capacity_tokens']} tokens ({held:.0f} full-length "
                       f"sequences); one step asks for up to {kv['demand_tokens']} tokens per engine"
                       + ("" if kv["capacity_tokens"] >= kv["demand_tokens"] else " (requests queue: rollout takes several waves)"))
    verdict = {EXIT_OK: "OK: the layout works and every phase fits",
               EXIT_LAYOUT: "FAILED: the layout cannot work (see ERROR lines)",
               EXIT_NOFIT: "FAILED: a phase does not fit in GPU memory (see the knobs)"}[plan["exit_code"]]
    out.append(f"verdict   {verdict}")
    return "\n".join(out)


def dry_run(pin: PlanInput, mode: str, opts: dict, config_path: str = "") -> int:
    """Print the plan and its JSON (last line); write ``--dry_run_json``; return the exit status."""
    plan = make_plan(pin, mode, opts)
    print(format_plan(plan, config_path))
    line = json.dumps(plan, sort_keys=True)
    if opts.get("dry_run_json"):
        with open(opts["dry_run_json"], "w") as f:
            f.write(line + "\n")
    print(line)
    sys.stdout.flush()
    if plan["exit_code"] == EXIT_LAYOUT:
        for e in plan["errors"]:
            print(f"megaforge: dry run: {e['message']}", file=sys.stderr)
    return plan["exit_code"]
