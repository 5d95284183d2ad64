"""Phases of a run on the worst GPU, their verdicts, and the knobs that make a phase fit.

Colocated RL step (DESIGN.md): ``rollout`` = engine (weights, KV cache, CUDA graphs, workspace) +
the trainer state left on the GPU (all of it with ``memory.offload: none``; the frozen reference in
every case unless ``trainer.ref_device: cpu``, since offload moves the policy only);
``train`` = trainer state + reference + activations + loss buffers + what the engine keeps (its CUDA
graphs: the loop releases ``weights`` and ``kv_cache``); ``sync`` = engine weights back + two
weight buckets (``sync.bucket_mb``) + the trainer residue. A distillation teacher
(:func:`memory.teacher_items`) is in every trainer phase, and in ``rollout`` / ``sync`` where it stays
on the GPU (served by the trainer with ``memory.offload: none``; an embedded engine serving it). Disaggregated: engine GPUs only see
``rollout``, trainer GPUs only ``train``. An SFT warm start (``sft.max_steps`` > 0, before the
engines exist) and the SFT launcher have an ``sft`` phase. With pipeline parallelism every stage
is estimated and the worst one reported.

Verdict: ``fits`` when allocated + reserves <= 95% of the GPU's memory, ``tight`` up to 100%,
``does not fit`` above (or when the KV cache cannot hold one sequence). Knobs are found by
re-running the whole plan with one config change at a time (:attr:`megaforge.specs.PlanInput.vary`) and keeping those after which the
phase fits.
"""
from __future__ import annotations

from megaforge.engine_kinds import engine_kind
from megaforge.planner import memory as M
from megaforge.planner.layout import check_layout
from megaforge.specs import PlanInput

FIT, TIGHT, NOFIT = "fits", "tight", "does not fit"


def _rename(items, suffix):
    return [M.Item(i.name + suffix, i.bytes, i.owner, i.note) for i in items]


def estimate(pin: PlanInput, shape, lay, hw, mode: str, reserve_gib: float, teacher=None) -> tuple[list, dict]:
    """(phases, KV facts). Each phase is the worst GPU's :class:`memory.Phase`; ``teacher``: the
    distillation teacher's shape (None: no teacher counted)."""
    mem = hw.memory_gib * M.GiB
    tres = reserve_gib * M.GiB
    rl = mode == "grpo" and pin.max_steps > 0
    separate_engine = bool(lay.engine) and not engine_kind(lay.engine).in_process
    eres = M.ENGINE_RESERVE_GIB * M.GiB if separate_engine else 0.0
    roll_items, engine_left, kv = (M.engine_items(pin, shape, lay, mem) if rl and lay.engine else ([], [], {}))
    phases = {}

    def teach(st):  # the teacher exists from the trainer's start: in the SFT warm start's phase too
        return M.teacher_items(pin, teacher, lay, st) if mode == "grpo" else []

    def worst(name, build, reserve, where=""):
        best = None
        for st in range(lay.pp):
            ph = M.Phase(name, build(st), reserve, ", ".join(x for x in (where, f"pipeline stage {st}" if lay.pp > 1 else "") if x))
            if best is None or ph.total > best.total:
                best = ph
        phases[name] = best

    if mode == "sft" or pin.sft.max_steps > 0:
        worst("sft", lambda st: M.trainer_state(pin, shape, lay, st) + teach(st) + M.work_items(pin, shape, lay, st, "sft"), tres)
    if rl:

        def residue(st):
            left = M.reference(pin, shape, lay, st, mode)
            if pin.teacher.served_by == "engine":  # an embedded engine's teacher is never offloaded
                left = teach(st) + left
            if pin.memory.offload == "none":
                state = M.trainer_state(pin, shape, lay, st) + (teach(st) if pin.teacher.served_by == "trainer" else [])
                left = _rename(state, " (resident: memory.offload none)") + left
            return left

        if lay.colocated:
            worst("rollout", lambda st: roll_items + residue(st), tres + eres, "engine GPU")
            worst("train", lambda st: M.trainer_state(pin, shape, lay, st) + M.reference(pin, shape, lay, st, mode)
                  + teach(st) + M.work_items(pin, shape, lay, st, "grpo") + engine_left, tres + eres)
            bucket_bytes = min(pin.sync.bucket_mb * (1 << 20), M.dtype_bytes(pin.model.dtype) * shape.hf_params())
            bucket = M.Item("weight buckets (2 x sync.bucket_mb)", 2.0 * bucket_bytes, "trainer", "a bucket in flight + its flat copy")
            worst("sync", lambda st: [roll_items[0]] + engine_left + [bucket] + residue(st), tres + eres)
        else:
            phases["rollout"] = M.Phase("rollout", roll_items, eres or tres, "rollout GPU")
            worst("train", lambda st: M.trainer_state(pin, shape, lay, st) + M.reference(pin, shape, lay, st, mode)
                  + teach(st) + M.work_items(pin, shape, lay, st, "grpo"), tres, "trainer GPU")
    order = [n for n in ("sft", "rollout", "train", "sync") if n in phases]
    out = [phases[n] for n in order]
    for ph in out:
        ph.verdict = verdict(ph, mem)
        ph.problem = ""
    if "rollout" in phases and kv.get("capacity_tokens") is not None and kv["capacity_tokens"] < kv["sequence_tokens"]:
        ph = phases["rollout"]
        ph.verdict = NOFIT
        ph.problem = (f"the KV cache holds {kv['capacity_tokens']} tokens, less than one sequence of {kv['sequence_tokens']} "
                      f"(rollout.mem_fraction {pin.rollout.mem_fraction} x {hw.memory_gib:.1f} GiB minus the engine weights)")
    return out, kv


def verdict(ph, mem: float) -> str:
    if ph.total <= 0.95 * mem:
        return FIT
    return TIGHT if ph.total <= mem else NOFIT


# ------------------------------------------------------------------------------------------ knobs
def _candidates(pin: PlanInput, lay, phase: str) -> list[tuple[str, dict]]:
    t, r = pin.trainer, pin.rollout
    out = []
    if phase in ("rollout", "sync"):
        if pin.memory.offload == "none" and lay.colocated:
            out.append(("set memory.offload: pinned", {"memory.offload": "pinned"}))
        if pin.grpo.beta > 0 and t.ref_device != "cpu":
            out.append(("set trainer.ref_device: cpu", {"trainer.ref_device": "cpu"}))
        if lay.engine and engine_kind(lay.engine).memory == "sglang":
            f = round(r.mem_fraction - 0.05, 2)
            while f >= 0.2:
                out.append((f"lower rollout.mem_fraction to {f}", {"rollout.mem_fraction": f}))
                f = round(f - 0.05, 2)
            f = round(r.mem_fraction + 0.05, 2)
            while f <= 0.9:
                out.append((f"raise rollout.mem_fraction to {f}", {"rollout.mem_fraction": f}))
                f = round(f + 0.05, 2)
            for n in (2, 4, 8):
                if n > r.tensor_parallel:
                    out.append((f"raise rollout.tensor_parallel to {n} (rollout.num_engines {max(1, r.num_engines * r.tensor_parallel // n)})",
                                {"rollout.tensor_parallel": n, "rollout.num_engines": max(1, r.num_engines * r.tensor_parallel // n)}))
            out.append(("lower the CUDA graph batch (rollout.extra_args: [--cuda-graph-max-bs, 64])",
                        {"rollout.extra_args": list(r.extra_args) + ["--cuda-graph-max-bs", "64"]}))
        else:
            b = r.engine_batch_size // 2
            while b >= 1:
                out.append((f"lower rollout.engine_batch_size to {b}", {"rollout.engine_batch_size": b}))
                b //= 2
        return out
    # train / sft
    if t.backend == "megatron":
        for rc in {"none": ("selective", "full"), "selective": ("full",)}.get(t.recompute, ()):
            out.append((f"set trainer.recompute: {rc}", {"trainer.recompute": rc}))
        if t.tensor_parallel > 1 and not t.sequence_parallel:
            out.append(("set trainer.sequence_parallel: true", {"trainer.sequence_parallel": True}))
        if not t.distributed_optimizer:
            out.append(("set trainer.distributed_optimizer: true", {"trainer.distributed_optimizer": True}))
        for n in (2, 4, 8):
            if n > t.tensor_parallel:
                out.append((f"raise trainer.tensor_parallel to {n} (with sequence_parallel)",
                            {"trainer.tensor_parallel": n, "trainer.sequence_parallel": True}))
        for n in (2, 4, 8):
            if n > t.pipeline_parallel:
                out.append((f"raise trainer.pipeline_parallel to {n}", {"trainer.pipeline_parallel": n}))
        for n in (2, 4):
            if n > t.context_parallel:
                out.append((f"raise trainer.context_parallel to {n}", {"trainer.context_parallel": n}))
    elif not t.gradient_checkpointing:
        out.append(("set trainer.gradient_checkpointing: true", {"trainer.gradient_checkpointing": True}))
    m = t.micro_batch_size // 2
    while m >= 1:
        out.append((f"lower trainer.micro_batch_size to {m}", {"trainer.micro_batch_size": m}))
        m //= 2
    if phase == "train" and pin.grpo.beta > 0 and t.ref_device != "cpu":
        out.append(("set trainer.ref_device: cpu", {"trainer.ref_device": "cpu"}))
    if phase == "train" and lay.engine and engine_kind(lay.engine).memory == "sglang" and lay.colocated:
        out.append(("lower the CUDA graph batch (rollout.extra_args: [--cuda-graph-max-bs, 64])",
                    {"rollout.extra_args": list(pin.rollout.extra_args) + ["--cuda-graph-max-bs", "64"]}))
    return out


def knobs(pin: PlanInput, shape, hw, mode: str, phase, reserve_gib: float, limit: int = 4, teacher=None) -> list[dict]:
    """Single config changes after which ``phase`` fits (and the layout is still valid), best
    first in the order tried; at most ``limit``. Each: {change, overrides, gib}. ``teacher``: as
    :func:`estimate`'s."""
    found, seen_keys = [], set()
    lay0, _, _ = check_layout(pin, shape, hw, mode)
    for desc, over in _candidates(pin, lay0, phase.name):
        family = tuple(sorted(over))
        if family in seen_keys:  # e.g. only the first mem_fraction / micro-batch value that fits
            continue
        alt = pin.vary(over)  # None: the change makes the configuration invalid
        if alt is None:
            continue
        lay, errs, _ = check_layout(alt, shape, hw, mode)
        if errs or lay is None:
            continue
        phases, _ = estimate(alt, shape, lay, hw, mode, reserve_gib, teacher)
        ph = next((p for p in phases if p.name == phase.name), None)
        if ph is None or ph.verdict != FIT:
            continue
        if any(p.verdict == NOFIT for p in phases):  # fixing one phase must not break another
            continue
        seen_keys.add(family)
        found.append({"change": desc, "overrides": over, "gib": round(ph.total / M.GiB, 2)})
        if len(found) >= limit:
            break
    return found
