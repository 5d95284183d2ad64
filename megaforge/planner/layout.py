"""Layout checks and placement: does the configured parallel layout divide the model and the GPUs,
and which rank / engine runs on which GPU of which node.

Trainer ranks follow megatron's default order ``tp-cp-ep-dp-pp`` (TP ranks adjacent):

    rank = tp + TP*(cp + CP*(dp + DP*pp)),   DP = W / (TP*PP*CP)

and experts the order ``tp-ep-dp-pp`` with expert-TP ETP = ``trainer.expert_tensor_parallel`` and
expert-DP ``EDP = W / (ETP*EP*PP)``. Global rank r sits on node ``r // G``, GPU ``r % G`` (G GPUs per node).

Rollout engines (:func:`engine_gpus`, which the run applies too): colocated, engine k takes GPUs
``[k*etp, (k+1)*etp)`` counted node-major over all GPUs; disaggregated (``rollout.num_gpus`` > 0),
every node gives its last ``num_gpus / nodes`` GPUs to engines and the rest to the trainer. An
in-process engine kind (``embedded``, megaforge.engine_kinds) lives in the trainer process of rank 0
(GPU 0 of node 0).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Optional

from megaforge.engine_kinds import ENGINE_KINDS, engine_kind, engine_kind_names
from megaforge.planner.shapes import ModelShape
from megaforge.specs import PlanInput

#: total memory of known GPUs in GiB (nvidia-smi totals: H100 81559 MiB, H200 143771 MiB, ...)
GPU_MEMORY_GIB = {
    "H200": 140.4, "H100": 79.6, "H800": 79.6, "H20": 95.0, "B200": 179.1, "GH200": 94.5,
    "A100": 80.0, "A100-80GB": 80.0, "A100-40GB": 40.0, "L40S": 45.0, "A10G": 22.5, "RTX4090": 23.6,
}


@dataclass
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu: str
    memory_gib: float
    assumed: list = field(default_factory=list)  # what was not given and how it was chosen

    @property
    def total(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Layout:
    backend: str
    world: int  # trainer ranks
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    sp: bool
    spec: str  # resolved megatron layer spec (te | torch); "hf" for the torch backend
    engine: str
    engine_tp: int
    num_engines: int
    colocated: bool
    rollout_gpus: int  # GPUs given to engines only (0 colocated)


@dataclass
class Issue:
    key: str
    message: str

    def __str__(self) -> str:
        """``key=value constraint`` / ``key x other = ... constraint`` / ``key: constraint``."""
        joined = self.message.startswith(("=", " x "))
        return f"{self.key}{'' if joined else ': '}{self.message}"


def resolve_gpu(name: Optional[str], memory_gib: Optional[float]) -> tuple[str, float]:
    if memory_gib:
        return (name or "custom"), float(memory_gib)
    if name:
        key = name.upper().replace("NVIDIA", "").replace(" ", "").strip("-")
        for k, v in GPU_MEMORY_GIB.items():
            if key == k.upper():
                return k, v
        raise ValueError(f"--gpu {name!r} is not a known GPU ({', '.join(GPU_MEMORY_GIB)}); give --gpu_memory_gib")
    return "80GB GPU (default)", 80.0


def resolve_spec(setting: str, backend: str) -> tuple[str, str]:
    """(spec, note): ``trainer.layer_spec`` auto resolves as the backend does (te when
    transformer_engine is importable here)."""
    if backend != "megatron":
        return "hf", ""
    if setting != "auto":
        return setting, ""
    te = importlib.util.find_spec("transformer_engine") is not None
    return ("te" if te else "torch"), f"trainer.layer_spec auto -> {'te' if te else 'torch'} (transformer_engine {'importable' if te else 'not importable'} here)"


def default_gpus(pin: PlanInput) -> int:
    """GPUs of one node when none are given: the smallest that holds one trainer replica and the
    disaggregated rollout GPUs."""
    t = pin.trainer
    if t.backend != "megatron":
        return 1 + pin.rollout.num_gpus
    return t.tensor_parallel * t.pipeline_parallel * t.context_parallel + pin.rollout.num_gpus


def check_layout(pin: PlanInput, shape: ModelShape, hw: Hardware, mode: str) -> tuple[Optional[Layout], list[Issue], list[str]]:
    """(layout or None, errors, warnings). Every error names the config key and the constraint."""
    t, r = pin.trainer, pin.rollout
    err: list[Issue] = []
    warn: list[str] = []
    megatron = t.backend == "megatron"
    tp, pp, cp, ep = t.tensor_parallel, t.pipeline_parallel, t.context_parallel, t.expert_parallel
    etp = t.expert_tensor_parallel
    if not megatron:
        for k, v in (("tensor_parallel", tp), ("pipeline_parallel", pp), ("context_parallel", cp), ("expert_parallel", ep),
                     ("expert_tensor_parallel", etp)):
            if v != 1:
                err.append(Issue(f"trainer.{k}", f"={v} needs trainer.backend megatron (the torch backend is data-parallel only)"))
        tp = pp = cp = ep = etp = 1
    spec, note = resolve_spec(t.layer_spec, t.backend)
    if note:
        warn.append(note)
    rl = mode == "grpo" and pin.max_steps > 0
    colocated = r.num_gpus == 0
    rollout_gpus = r.num_gpus if rl else 0
    if rollout_gpus and rollout_gpus % hw.nodes:
        err.append(Issue("rollout.num_gpus", f"={r.num_gpus} is not divisible by the {hw.nodes} nodes (every node gives the same number of GPUs to engines)"))
    world = hw.total - rollout_gpus
    if world < 1:
        err.append(Issue("rollout.num_gpus", f"={r.num_gpus} leaves no GPU for the trainer ({hw.nodes} x {hw.gpus_per_node} GPUs)"))
        world = 1
    # ---- the model
    if megatron and not shape.megatron_supported:
        warn.append(f"model_type {shape.model_type}: megaforge's megatron backend has no family for it yet "
                    "(megaforge/convert/families.py); the plan below is for the layout, the run cannot start today")
    if shape.heads % tp:
        err.append(Issue("trainer.tensor_parallel", f"={tp} does not divide num_attention_heads={shape.heads}"))
    if shape.kv_heads % tp:
        err.append(Issue("trainer.tensor_parallel", f"={tp} does not divide num_key_value_heads={shape.kv_heads} "
                         "(megatron splits whole key/value groups over TP)"))
    if shape.ffn % tp and len(shape.moe_layers) < shape.layers:
        err.append(Issue("trainer.tensor_parallel", f"={tp} does not divide intermediate_size={shape.ffn}"))
    lora_mlp = [m for m in (pin.model.lora.target_modules if pin.model.lora is not None else [])
                if m in ("gate_proj", "up_proj", "down_proj")]
    if megatron and lora_mlp and shape.moe_layers:  # megaforge.trainer.megatron.lora.check_lora, before the run
        err.append(Issue("model.lora.target_modules", f"{lora_mlp} would target the mixture-of-experts layers' experts, "
                         "which the megatron backend's LoRA does not adapt: target the attention projections only"))
    if shape.layers % pp:
        err.append(Issue("trainer.pipeline_parallel", f"={pp} does not divide num_hidden_layers={shape.layers}"))
    if ep > 1 and not shape.is_moe:
        err.append(Issue("trainer.expert_parallel", f"={ep} needs a mixture-of-experts model ({shape.model_type} has no experts)"))
    if shape.is_moe:
        if shape.experts % ep:
            err.append(Issue("trainer.expert_parallel", f"={ep} does not divide num_experts={shape.experts}"))
        if shape.expert_ffn % etp:
            err.append(Issue("trainer.expert_tensor_parallel", f"={etp} does not divide moe_intermediate_size={shape.expert_ffn}"))
        if ep > 1 and tp > 1 and not t.sequence_parallel:
            warn.append("trainer.expert_parallel > 1 with trainer.tensor_parallel > 1: megatron wants trainer.sequence_parallel true")
        if megatron and t.moe_experts == "grouped" and spec != "te":
            err.append(Issue("trainer.moe_experts", f"=grouped needs trainer.layer_spec te (Transformer Engine's GroupedLinear); "
                             f"layer_spec is {spec}: use moe_experts sequential or auto"))
    # ---- the GPUs
    if world % (tp * pp * cp):
        what = "needs more GPUs than" if tp * pp * cp > world else "does not divide"
        err.append(Issue("trainer.tensor_parallel", f" x pipeline_parallel x context_parallel = {tp} x {pp} x {cp} = {tp * pp * cp} "
                         f"{what} the {world} trainer GPUs ({hw.nodes} node(s) x {hw.gpus_per_node} GPUs"
                         + (f" - rollout.num_gpus {rollout_gpus})" if rollout_gpus else ")")))
    dp = max(1, world // (tp * pp * cp))
    if shape.is_moe and world % (etp * ep * pp):
        err.append(Issue("trainer.expert_parallel", f"={ep}: expert-TP x EP x PP = {etp} x {ep} x {pp} does not divide the "
                         f"{world} trainer GPUs (megatron: (CP x DP) % EP == 0, here CP x DP = {cp * dp})"))
    edp = max(1, world // (etp * ep * pp))
    if tp > hw.gpus_per_node:
        warn.append(f"trainer.tensor_parallel={tp} spans nodes (gpus_per_node={hw.gpus_per_node}): TP traffic crosses the network")
    seq = pin.sft.max_len if mode == "sft" else pin.data.max_prompt_len + r.max_new_tokens
    if megatron and cp > 1 and seq % (2 * cp):
        warn.append(f"trainer.context_parallel={cp}: sequences of up to {seq} tokens are padded to multiples of "
                    f"2 x context_parallel = {2 * cp} by megaforge's packing (load-balanced CP chunks)")
    if megatron and t.fp8 and spec != "te":
        err.append(Issue("trainer.fp8", f"={t.fp8} needs the te layer spec (trainer.layer_spec resolves to {spec})"))
    # ---- batch vs data parallelism
    seqs = _sequences(pin, mode)
    if megatron and seqs < dp * (pin.trainer.mini_batches if mode == "grpo" else 1):
        key = "rollout.batch_size" if mode == "grpo" else "sft.batch_size"
        err.append(Issue(key, f"a mini-batch of {seqs // max(1, pin.trainer.mini_batches if mode == 'grpo' else 1)} "
                         f"sequences cannot feed {dp} data-parallel ranks"))
    # ---- rollout engines
    engine, etp_r, n_eng = r.engine, r.tensor_parallel, r.num_engines
    kind = ENGINE_KINDS.get(engine) if engine in ENGINE_KINDS else None
    if rl:
        if kind is None:
            err.append(Issue("rollout.engine", f"={engine} is not available in this build (valid: "
                             f"{', '.join(engine_kind_names())})"))
        elif kind.in_process:
            etp_r, n_eng = 1, 1
            if getattr(r, "fast", "off") != "off":
                warn.append(f"rollout.fast={r.fast}: the estimate models the embedded engine's simple DynamicCache "
                            "loop; its fast path (static KV cache, CUDA graphs) is not modelled yet")
            if not colocated:
                warn.append(f"rollout.num_gpus is ignored by the {engine} engine (it runs in the trainer's rank-0 process)")
                rollout_gpus, colocated = 0, True
        if kind is not None and kind.max_tp and etp_r > kind.max_tp:
            err.append(Issue("rollout.tensor_parallel", f"={etp_r}: rollout.engine {engine} runs TP {kind.max_tp} at most "
                             "(use rollout.num_engines)"))
        if kind is not None and not kind.in_process:
            if shape.heads % etp_r:
                err.append(Issue("rollout.tensor_parallel", f"={etp_r} does not divide num_attention_heads={shape.heads}"))
            if shape.kv_heads % etp_r and etp_r % shape.kv_heads:
                err.append(Issue("rollout.tensor_parallel", f"={etp_r} neither divides nor is a multiple of num_key_value_heads={shape.kv_heads}"))
            if etp_r > hw.gpus_per_node:
                err.append(Issue("rollout.tensor_parallel", f"={etp_r} exceeds gpus_per_node={hw.gpus_per_node} (an engine cannot span nodes)"))
            need = n_eng * etp_r
            pool = rollout_gpus if not colocated else hw.total
            if need > pool:
                err.append(Issue("rollout.num_engines", f" x rollout.tensor_parallel = {n_eng} x {etp_r} = {need} GPUs > the {pool} "
                                 + ("rollout GPUs (rollout.num_gpus)" if not colocated else "GPUs of the job (colocated)")))
            elif colocated and need < hw.total:
                warn.append(f"engines use {need} of the {hw.total} GPUs: the others idle during rollout")
            per_node = (rollout_gpus // hw.nodes) if not colocated else hw.gpus_per_node
            if etp_r <= hw.gpus_per_node and per_node % etp_r and need > etp_r:
                err.append(Issue("rollout.tensor_parallel", f"={etp_r} does not divide the {per_node} engine GPUs of a node "
                                 "(an engine would span two nodes)"))
    lay = Layout(t.backend, world, tp, pp, cp, dp, ep, etp if shape.is_moe else tp, edp, bool(t.sequence_parallel and megatron), spec,
                 engine if rl else "", etp_r, n_eng if rl else 0, colocated, rollout_gpus)
    return (None if err else lay), err, warn


def _sequences(pin: PlanInput, mode: str) -> int:
    if mode == "sft":
        return pin.sft.batch_size
    return pin.rollout.batch_size * pin.grpo.n_samples


def engine_gpus(num_engines: int, engine_tp: int, rollout_gpus: int, nodes: int, gpus_per_node: int) -> list[list[tuple[int, int]]]:
    """The GPUs of each engine server, ``[(node, gpu) of TP rank 0, 1, ...]`` per engine id: the one
    placement of engines, which the planner reports and the run applies (single node:
    megaforge.rollout.http.start.gpu_assignment; several: megaforge.placement.engine_slots).

    Colocated (``rollout_gpus == 0``): engine k, TP rank j on GPU ``k*engine_tp + j`` counted node-major
    over all ``nodes x gpus_per_node`` GPUs; disaggregated: the same over the last ``rollout_gpus / nodes``
    GPUs of every node. An engine rank beyond those GPUs gets none (check_layout reports it)."""
    per_node_roll = rollout_gpus // nodes if rollout_gpus else 0
    first = gpus_per_node - per_node_roll
    slots = ([(n, first + g) for n in range(nodes) for g in range(per_node_roll)] if rollout_gpus
             else [(n, g) for n in range(nodes) for g in range(gpus_per_node)])
    return [[slots[k * engine_tp + j] for j in range(engine_tp) if k * engine_tp + j < len(slots)]
            for k in range(num_engines)]


def placement(lay: Layout, hw: Hardware) -> list[dict]:
    """One row per GPU: node, gpu, trainer rank and coordinates, engine and engine rank."""
    rows = []
    per_node_roll = lay.rollout_gpus // hw.nodes if lay.rollout_gpus else 0
    per_node_train = hw.gpus_per_node - per_node_roll
    trainer_slots = [(n, g) for n in range(hw.nodes) for g in range(per_node_train)]
    table = {(n, g): {"node": n, "gpu": g} for n in range(hw.nodes) for g in range(hw.gpus_per_node)}
    for rank, slot in enumerate(trainer_slots[: lay.world]):
        c = {"rank": rank, "tp": rank % lay.tp, "cp": (rank // lay.tp) % lay.cp,
             "dp": (rank // (lay.tp * lay.cp)) % lay.dp, "pp": rank // (lay.tp * lay.cp * lay.dp)}
        if lay.ep > 1:
            c["ep"] = (rank // lay.etp) % lay.ep
            c["edp"] = (rank // (lay.etp * lay.ep)) % lay.edp
        table[slot]["trainer"] = c
    if lay.engine and engine_kind(lay.engine).in_process:
        table[(0, 0)]["engine"] = {"id": 0, "tp_rank": 0, "in_process": True}
    elif lay.engine:
        for k, gpus in enumerate(engine_gpus(lay.num_engines, lay.engine_tp, lay.rollout_gpus, hw.nodes, hw.gpus_per_node)):
            for j, slot in enumerate(gpus):
                table[slot]["engine"] = {"id": k, "tp_rank": j}
    for key in sorted(table):
        rows.append(table[key])
    return rows
