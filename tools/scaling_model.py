"""The cost model of tools/scaling_study.py: one RL step's time from the layout, the model's shape,
the step's workload and the hardware, with a few coefficients fitted on measured points.

Notation (one layout): ``N`` GPUs on nodes of ``g`` GPUs; ``R`` rollout-only GPUs (0 colocated) and
``N_t = N - R`` trainer GPUs; TP ``t``, PP ``p``, CP ``c``, DP ``d = N_t / (t p c)``; ``E`` engines of
TP ``e``; ``m`` micro-batches per DP rank per step. Model: ``P`` parameters (``P_a`` active per
token, = P for dense models), ``L`` layers, hidden ``h``, key+value width ``kv = 2 * kv_heads *
head_dim``, ``b`` bytes per weight/activation element (model.dtype), ``b_g = 4`` per gradient element.
Workload per step: ``K`` tokens trained (prompts + responses), ``G`` tokens generated.
Hardware: ``B_in`` (GB/s per GPU inside a node, NVLink), ``B_x`` (GB/s per GPU between nodes),
``a`` (seconds of latency per collective). A collective whose group spans nodes runs at ``B_x``.
Ring collectives move ``2 (n-1)/n`` (all-reduce) or ``(n-1)/n`` (all-gather, reduce-scatter) of the
buffer per GPU.

    T_rollout = r0 + r1 * G / (E * e**rho)                 generated tokens per engine (rho: decode TP
                                                           exponent, default 1: TP e serves e times faster)
    T_train   = k0 + k1 * 6 * P_a * K / N_t * (m + p - 1) / m            compute, stretched by the PP
                                                           bubble fraction (p-1)/(m+p-1)
              + 4 * (L/p) * [2 (t-1)/t] * (K / (d c)) * h * b / B_tp  + 4 * (L/p) * m * a * [t > 1]
                                                           TP: 2 all-reduces of activations per layer
                                                           forward, 2 backward (sequence parallel moves
                                                           the same bytes as reduce-scatter + all-gather)
              + 3 * (L/p) * [(c-1)/c] * (K / d) * kv * b / B_cp        CP: K/V all-gather forward, their
                                                           gradients reduce-scattered backward
              + [2 (d-1)/d] * (P / (t p)) * b_g / B_dp                 DP: gradient all-reduce (ring)
    T_sync    = s0 + s1 * P * b  + [R > 0] * P * b / B_link            weight push (gather + copy), plus
                                                           the network hop to engines on their own GPUs
    T_offload + T_onload = o0 + o1 * S,   S = P/(t p) * (b + 4) + 12 * P / (t p d)
                                                           trainer state bytes per GPU (weights, fp32 grads,
                                                           Adam + master weights sharded over DP)
    T_other   = x0                                         logging, rewards, step bookkeeping
    T_step    = T_rollout + T_train + T_sync + T_offload + T_onload + T_other

``k1, r1, s1, o1`` (seconds per FLOP / per generated token / per byte) and the intercepts ``k0, r0,
s0, o0, x0`` are fitted by least squares (non-negative) on the measured points' per-phase times,
after subtracting the communication terms the hardware constants give; with one point only the
slopes are fitted (intercepts 0). Communication constants are not fitted: on a single node they are
barely observable, and a fitted bandwidth would only absorb noise. Every measured point is also
predicted by a fit on the other points (leave-one-out) and the relative error reported.

Projection to 64-1024 GPUs keeps the reference layout's TP/PP/CP, engine TP and rollout-GPU
fraction (engines per GPU; the embedded engine stays one, in rank 0) and grows DP; ``batch: weak`` keeps tokens per DP rank (K and G grow with d, m constant),
``strong`` keeps K and G (m shrinks with d, at least 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GB = 1e9
#: hardware presets: per-GPU GB/s inside a node and between nodes, seconds per collective, GPUs per node
HARDWARE = {
    "h200": {"intra_gbps": 400.0, "inter_gbps": 45.0, "latency_s": 2e-5, "gpus_per_node": 8},
    "h100": {"intra_gbps": 400.0, "inter_gbps": 45.0, "latency_s": 2e-5, "gpus_per_node": 8},
    "a100": {"intra_gbps": 250.0, "inter_gbps": 22.0, "latency_s": 2e-5, "gpus_per_node": 8},
    "cpu": {"intra_gbps": 2.0, "inter_gbps": 1.0, "latency_s": 1e-4, "gpus_per_node": 64},  # gloo over loopback
}
PHASES = ("rollout", "train", "sync", "offload_onload", "other")


@dataclass
class Point:
    """One layout with its workload (and measured per-phase seconds when it was run)."""

    gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    engines: int = 1
    engine_tp: int = 1
    rollout_gpus: int = 0
    micro_batches: int = 1
    tokens: float = 0.0  # K
    gen_tokens: float = 0.0  # G
    measured: dict = field(default_factory=dict)  # phase -> seconds (PHASES), plus "step"
    name: str = ""
    fixed_engines: bool = False  # the engine count does not grow with GPUs (the embedded engine: one, in rank 0)

    @property
    def trainer_gpus(self) -> int:
        return self.gpus - self.rollout_gpus

    @property
    def dp(self) -> int:
        return max(1, self.trainer_gpus // (self.tp * self.pp * self.cp))


@dataclass
class Shape:
    params: float  # P
    active_params: float  # P_a
    layers: int
    hidden: int
    kv: int  # 2 * kv_heads * head_dim
    bytes_per_el: int = 2


@dataclass
class Hardware:
    intra_gbps: float
    inter_gbps: float
    latency_s: float
    gpus_per_node: int
    rho: float = 1.0

    @classmethod
    def make(cls, spec: dict) -> "Hardware":
        base = dict(HARDWARE[spec.get("preset", "h200")])
        base.update({k: v for k, v in spec.items() if k != "preset"})
        return cls(**base)

    def bw(self, span_gpus: int) -> float:
        """Bytes/s of a collective over a group spanning ``span_gpus`` consecutive GPUs."""
        return (self.intra_gbps if span_gpus <= self.gpus_per_node else self.inter_gbps) * GB


def shape_from_planner(s, dtype_bytes: int) -> Shape:
    """Our Shape from megaforge.planner.shapes.ModelShape."""
    p = float(s.hf_params())
    active = p
    if s.is_moe:
        active -= len(s.moe_layers) * (s.experts - s.topk) * 3 * s.hidden * s.expert_ffn
    return Shape(p, active, s.layers, s.hidden, 2 * s.kvd, dtype_bytes)


# ----------------------------------------------------------------------------------------- features
def features(pt: Point, sh: Shape, hw: Hardware) -> dict:
    """Per phase: (x, known seconds). The fitted part is ``c0 + c1 * x``; ``known`` is communication."""
    t, p, c, d, m, b = pt.tp, pt.pp, pt.cp, pt.dp, max(1, pt.micro_batches), sh.bytes_per_el
    per_layer = sh.layers / p
    flops = 6.0 * sh.active_params * pt.tokens / pt.trainer_gpus * (m + p - 1) / m
    tp_s = 4 * per_layer * (2 * (t - 1) / t) * (pt.tokens / (d * c)) * sh.hidden * b / hw.bw(t)
    tp_s += 4 * per_layer * m * hw.latency_s * (t > 1)
    cp_s = 3 * per_layer * ((c - 1) / c) * (pt.tokens / d) * sh.kv * b / hw.bw(t * c)
    dp_s = (2 * (d - 1) / d) * (sh.params / (t * p)) * 4 / hw.bw(pt.trainer_gpus)
    weights = sh.params * b
    link = weights / hw.bw(pt.gpus) if pt.rollout_gpus else 0.0
    state = sh.params / (t * p) * (b + 4) + 12 * sh.params / (t * p * d)
    return {"rollout": (pt.gen_tokens / (pt.engines * pt.engine_tp ** hw.rho), 0.0), "train": (flops, tp_s + cp_s + dp_s),
            "sync": (weights, link), "offload_onload": (state, 0.0), "other": (0.0, 0.0)}


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Non-negative least squares for y = c0 + c1 x (c0 = 0 with a single point or constant x > 0)."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    if all(x == 0 for x in xs):
        return max(0.0, sum(ys) / n), 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n >= 2 and sxx > 1e-12 * max(mx * mx, 1e-300):
        c1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        c0 = my - c1 * mx
        if c0 >= 0 and c1 >= 0:
            return c0, c1
        if c1 < 0:
            return max(0.0, my), 0.0
    c1 = sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-300)  # through the origin
    return 0.0, max(0.0, c1)


@dataclass
class Fit:
    coef: dict  # phase -> (c0, c1)
    shape: Shape
    hw: Hardware

    def predict(self, pt: Point) -> dict:
        f = features(pt, self.shape, self.hw)
        out = {ph: self.coef[ph][0] + self.coef[ph][1] * f[ph][0] + f[ph][1] for ph in PHASES}
        out["step"] = sum(out[ph] for ph in PHASES)
        return out


def fit(points: list[Point], sh: Shape, hw: Hardware) -> Fit:
    coef = {}
    for ph in PHASES:
        xs, ys = [], []
        for pt in points:
            x, known = features(pt, sh, hw)[ph]
            xs.append(x)
            ys.append(pt.measured[ph] - known)
        coef[ph] = _fit_line(xs, ys)
    return Fit(coef, sh, hw)


def leave_one_out(points: list[Point], sh: Shape, hw: Hardware) -> list[dict]:
    """Each measured point predicted by a fit on the others: measured, predicted, relative error."""
    rows = []
    for i, pt in enumerate(points):
        others = points[:i] + points[i + 1:]
        if not others:
            continue
        pred = fit(others, sh, hw).predict(pt)
        row = {"name": pt.name, "gpus": pt.gpus, "fit_on": ",".join(o.name for o in others),
               "measured_step_s": pt.measured["step"], "predicted_step_s": pred["step"],
               "rel_error": (pred["step"] - pt.measured["step"]) / pt.measured["step"]}
        for ph in PHASES:
            row[f"measured_{ph}_s"], row[f"predicted_{ph}_s"] = pt.measured[ph], pred[ph]
        rows.append(row)
    return rows


def project(ref: Point, gpus: int, batch: str = "weak") -> Point:
    """The reference layout grown to ``gpus`` GPUs (see the module docstring)."""
    scale = gpus / ref.gpus
    rollout = int(round(ref.rollout_gpus * scale))
    if ref.fixed_engines:
        engines = ref.engines
    else:
        engines = max(1, rollout // ref.engine_tp) if ref.rollout_gpus else max(1, int(round(ref.engines * scale)))
    pt = replace(ref, gpus=gpus, rollout_gpus=rollout, engines=engines, measured={}, name=f"proj_{gpus}")
    grow = pt.dp / ref.dp
    if batch == "weak":
        pt.tokens, pt.gen_tokens = ref.tokens * grow, ref.gen_tokens * grow
    else:
        pt.micro_batches = max(1, math.ceil(ref.micro_batches / grow))
    return pt


def projections(model: Fit, ref: Point, base: Point, targets: list[int], batch: str) -> list[dict]:
    """Predicted phases, step time, tokens/s and efficiency (per-GPU throughput vs ``base``'s
    measured one) at each target GPU count."""
    base_tps = base.tokens / base.measured["step"]
    rows = []
    for n in targets:
        pt = project(ref, n, batch)
        pred = model.predict(pt)
        tps = pt.tokens / pred["step"]
        row = {"gpus": n, "tp": pt.tp, "pp": pt.pp, "cp": pt.cp, "dp": pt.dp, "engines": pt.engines,
               "engine_tp": pt.engine_tp, "rollout_gpus": pt.rollout_gpus, "tokens_per_step": pt.tokens,
               "micro_batches": pt.micro_batches, **{f"{ph}_s": pred[ph] for ph in PHASES}, "step_s": pred["step"],
               "tokens_per_s": tps, "scaling_efficiency": (tps / n) / (base_tps / base.gpus), "batch": batch}
        rows.append(row)
    return rows
