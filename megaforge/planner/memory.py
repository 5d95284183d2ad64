"""Per-GPU memory estimate of each phase, in bytes, from the model shape and the layout.

Notation as in :mod:`megaforge.planner.shapes`; ``p`` bytes per element of ``model.dtype``, ``t`` TP,
``c`` CP, ``P`` parameters on the rank (:meth:`ModelShape.stage_params`), ``s`` tokens of one
micro-batch on the rank (``micro_batch_size`` rows of the longest length, packed, / c).

Trainer state (megatron backend, bf16/fp16 params): weights ``p*P``; gradients ``4*P`` (megatron
DDP reduces in an fp32 main-grad buffer); Adam ``12*P`` (fp32 master copy + two fp32 moments; 8*P
for fp32 params) divided by DP*CP (dense) / expert-DP (experts) with the distributed optimizer.
torch backend: weights, gradients, two AdamW moments in the parameter dtype (``4*p*P``), plus a
DDP bucket copy of the gradients (``p*P``) with more than one rank. The frozen reference (``grpo.beta
> 0``, ``trainer.ref_device: same``) adds ``p*P``. With ``model.lora`` (torch backend) gradients,
AdamW moments and buckets count the adapters' ``P_a`` (:meth:`ModelShape.lora_params`) instead of ``P``,
the weights ``p*(P + P_a)``, and the reference is the base with the adapters off (no second copy); on the
megatron backend the fp32 main gradients and Adam state are those of the rank's adapter shards
(:func:`megatron_lora_params`) and the base's weights ``p*P`` stay.

Distillation teacher (``algo.advantage: distill``; its shape from ``--teacher_config`` or the HF folder at
``teacher.path``, :func:`megaforge.planner.shapes.read_teacher_shape`), ``p_t`` bytes per element of
``teacher.dtype`` (auto: ``model.dtype``): served by the trainer (``teacher.served_by: trainer``) its frozen
weights ``p_t*P_t`` (megatron: this rank's TP / PP share of the teacher's own layers; torch: the HF model),
on the GPU in the train phase and moved to host memory with the trainer state (``memory.offload``, as
megaforge.trainer's ``offload_entries``); served by an embedded engine (``served_by: engine``, no
``teacher.url``) an HF model ``p_t*P_t`` on ``rollout.device`` in every phase; by an SGLang server at
``teacher.url``, nothing on these GPUs. Its scoring forward is not counted: no gradients, one micro-batch
(or the engine's batch) at a time before the update, so one batch's logits and one layer's activations,
below the update's activations and loss buffers at the same micro-batch.

Activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", per layer ``s*b*h*(34 + 5*a*s/h)`` with LayerNorm, GeLU and dropout) adapted to what
megaforge's layers save: RMSNorm, GQA, SwiGLU, no dropout, SDPA / flash attention (no ``s^2``
term: only q, k, v, the output and an fp32 log-sum-exp per head are kept). Per token and layer:

    R = 2*n*h + 2*p*h                     norm inputs (n bytes per element) + qkv / fc1 inputs;
                                          divided by t only with sequence parallelism
    A = p*(qd + 2*kvd)                    qkv projection output (kept alive by the v view)
      + p*(qd + kvd)                      q, k after RoPE
      + [n*(qd + kvd)]                    q/k RMSNorm inputs (Qwen3)
      + o*p*qd + 4*a                      attention output (o = 2 copies with SDPA, 1 with TE) + lse
      + 3*p*F   (megatron fused SwiGLU; 4*p*F for HF's unfused act(gate)*up)
    per layer = R / (t if SP else 1) + A / t
    n = 4 + p for megaforge's / HF's RMSNorm (fp32 copy + normalised output), p for TE's.
    MoE layer: the dense 3*p*F becomes 4*E (fp32 router logits, with R) + k*(2*p*h + 3*p*Fe/t)
      (k dispatched copies per token, balanced routing: permuted input + unpermute input + SwiGLU),
      + 3*p*Fs/t for a shared expert.
    Recompute: selective (megatron's core_attn) drops the attention output copy and the lse;
      full (uniform, 1 layer) keeps p*h/(t if SP) per layer plus one layer recomputed in backward.
    CP with the torch spec: SDPA's efficient kernel (the one taking masks) keeps the all-gathered
      K/V of the whole sequence, expanded to the query heads under GQA (2*p*qd*c/t per local token;
      2*p*kvd*c/t without GQA), and the boolean + additive mask, (1 + p) * rows * (S/c) * S bytes.
    1F1B pipeline: stage 0 holds min(PP, micro-batches) micro-batches of its L/PP layers.

Loss (last stage), per token and local vocabulary column V/t (megaforge.trainer.megatron.logprobs):
14 bytes (forward: bf16 logits + fp32 copy saved for backward + two fp32 exp temporaries; backward:
the fp32 copy, p, the fp32 gradient and its bf16 cast), for SFT, logprob passes and RL steps whose
entropy is detached (``algo.entropy_coef`` 0); 26 with an entropy bonus (three more fp32
temporaries of the entropy gradient). With ``trainer.fused_logprobs`` (megatron backend, on for
CUDA unless ``false``) the sums and the gradient are compiled kernels: 2*p (the logits kept for
backward, their gradient), +p for the logits / temperature copy when the temperature is not 1.
The torch backend's RL step with ``trainer.head_positions: trained`` runs the head on the trained
positions only: at most ``rows * min(seq, rollout.max_new_tokens)`` per micro-batch (a row's trained
tokens stay within max_new_tokens), plus their gathered hidden states (p bytes x hidden each).

Engines: SGLang holds ``mem_fraction * M`` (weights ``p*P/etp`` + KV pool) plus CUDA graphs
(``0.5 GiB + max_bs*(4*V/etp + p*(4h + (qd + 2kvd)/etp + 3*F'/etp))``, ``F' = F`` or ``k*Fe``) and
a prefill workspace (``chunk*p*(2h + (qd + 2kvd)/etp + 3*F'/etp) + 8*max_bs*V``). KV per token:
``2*L*max(g/etp, 1)*d*kv_bytes``. The embedded (HF) engine: weights ``p*P``, DynamicCache
``B*(P+N)*2*L*g*d*p`` (+1/L while a layer's cache is re-concatenated), prefill logits of every
prompt position ``B*P*V*p`` with one layer's activations and the padding mask ``B*P^2``, and
``B*V*(p + 29)`` for sampling (the fp32 scaled logits, the Gumbel noise's int64 / fp64 temporaries).

Optimizer step: PyTorch's foreach Adam (megatron-core's fallback without Transformer Engine or Apex,
and the torch backend's AdamW) allocates the square root of the second moment, one temporary per
updated parameter (4 B, fp32 master params; ``p`` B for the torch backend), after the activations
are freed: the train peak is state + max(activations + loss, that temporary). TE's fused Adam has
none.

These are what ``torch.cuda.max_memory_allocated`` counts; the verdict adds a reserve per process
for the CUDA context, NCCL buffers and allocator slack (``--reserve_gib``, default 2 for the trainer,
1 for a separate engine process).
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from megaforge.config.rollout import server_flags
from megaforge.engine_kinds import engine_kind
from megaforge.specs import PlanInput

GiB = float(1 << 30)
ENGINE_RESERVE_GIB = 1.0
SGLANG_GRAPH_BASE = 0.5 * GiB
SGLANG_DEFAULT_MAX_BS = 256
SGLANG_DEFAULT_CHUNK = 8192
LOSS_BYTES_ENTROPY, LOSS_BYTES_FWD = 26, 14


@dataclass
class Item:
    name: str
    bytes: float
    owner: str  # trainer | engine
    note: str = ""


@dataclass
class Phase:
    name: str
    items: list = field(default_factory=list)
    reserve: float = 0.0
    where: str = ""  # which GPU kind / pipeline stage is the worst

    @property
    def allocated(self) -> float:
        return sum(i.bytes for i in self.items)

    @property
    def total(self) -> float:
        return self.allocated + self.reserve

    def owned(self, owner: str) -> float:
        return sum(i.bytes for i in self.items if i.owner == owner)


def dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else 2


def _extra_arg(flags: dict, flag: str, default):
    """The first value of ``flag`` in :func:`server_flags`' dict, as ``default``'s type; ``default`` when absent."""
    vals = flags.get(flag)
    if not vals:
        return default
    return type(default)(vals[0]) if default is not None else vals[0]


def _graph_max_bs(flags: dict) -> int:
    """The largest decode batch SGLang captures a CUDA graph for: 0 with --disable-cuda-graph; the largest size
    listed after --cuda-graph-bs-decode (or --cuda-graph-bs) when given; else --cuda-graph-max-bs, else its default.
    ``flags``: :func:`megaforge.config.rollout.server_flags` of rollout.extra_args."""
    if "--disable-cuda-graph" in flags:
        return 0
    for flag in ("--cuda-graph-bs-decode", "--cuda-graph-bs"):
        if flags.get(flag):
            return max(int(v) for v in flags[flag])
    return _extra_arg(flags, "--cuda-graph-max-bs", SGLANG_DEFAULT_MAX_BS)


# ---------------------------------------------------------------------------------- trainer state
def trainer_state(pin: PlanInput, shape, lay, stage: int) -> list[Item]:
    p = dtype_bytes(pin.model.dtype)
    if lay.backend == "megatron":
        sp = shape.stage_params(lay.tp, lay.pp, stage, lay.ep, lay.etp)
        if pin.model.lora is not None:  # the frozen base; fp32 main grads and Adam for this rank's adapters alone
            n, na = sum(sp.values()), megatron_lora_params(shape, pin.model.lora, lay.tp, lay.pp, stage)
            return [Item("trainer weights", p * n, "trainer", f"{n / 1e9:.3f} B params x {p} B (frozen base)"),
                    *_megatron_state(pin, lay, p, na, 0, "LoRA adapters ")]
        items = _megatron_state(pin, lay, p, sp["dense"] + sp["embedding"] + sp["output"], sp["expert"], "")
        if pin.critic_enabled and pin.max_steps > 0:  # a second GPTModel, the output layer replaced by a value head
            head = (shape.hidden + 1) if stage == lay.pp - 1 else 0
            items += _megatron_state(pin, lay, p, sp["dense"] + sp["embedding"] + head, sp["expert"], "critic ")
        return items
    n = shape.hf_params()
    lora = pin.model.lora
    if lora is not None:  # model.lora: the frozen base, and gradients / AdamW for the adapters alone
        na = shape.lora_params(lora.rank, lora.target_modules)
        items = [Item("trainer weights", p * n, "trainer", f"{n / 1e9:.3f} B params x {p} B (frozen base)"),
                 Item("LoRA adapters", p * na, "trainer", f"{na / 1e6:.2f} M params (rank {lora.rank}) x {p} B"),
                 Item("gradients", p * na, "trainer", f"{p} B/param of the adapters")]
        n = na
    else:
        items = [Item("trainer weights", p * n, "trainer", f"{n / 1e9:.3f} B params x {p} B"),
                 Item("gradients", p * n, "trainer", f"{p} B/param")]
    if lay.world > 1:
        items.append(Item("DDP gradient buckets", p * n, "trainer", f"{p} B/param"))
    items.append(Item("optimizer (AdamW)", 2.0 * p * n, "trainer", f"2 moments x {p} B/param"))
    if pin.critic_enabled and pin.max_steps > 0:
        nc = n - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden + 1
        items.append(Item("critic (weights+grads+AdamW)", 4.0 * p * nc, "trainer", "4 x p B/param of the backbone"))
    return items


def teacher_items(pin: PlanInput, tshape, lay, stage: int) -> list[Item]:
    """The distillation teacher's frozen weights on a trainer GPU of pipeline stage ``stage`` (``tshape``:
    its :class:`~megaforge.planner.shapes.ModelShape`; see module docstring); [] without a teacher on
    these GPUs."""
    t = pin.teacher
    if tshape is None or not t.path or (t.served_by == "engine" and (t.url or pin.rollout.device == "cpu")):
        return []
    p = dtype_bytes(pin.model.dtype if t.dtype == "auto" else t.dtype)
    if t.served_by == "engine":
        n = tshape.hf_params()
        return [Item("teacher engine weights", p * n, "trainer",
                     f"{n / 1e9:.3f} B params x {p} B (teacher.served_by engine: an embedded engine)")]
    if lay.backend == "megatron":
        n = sum(tshape.stage_params(lay.tp, lay.pp, stage, lay.ep, lay.etp).values())
    else:
        n = tshape.hf_params()
    return [Item("teacher weights (frozen)", p * n, "trainer", f"{n / 1e9:.3f} B params x {p} B (teacher.served_by trainer)")]


def megatron_lora_params(shape, lora, tp: int, pp: int, stage: int) -> int:
    """The megatron backend's adapter parameters on one rank of stage ``stage``
    (megaforge.trainer.megatron.lora): per adapted projection of the stage's dense layers, r * (in + out/t)
    for column-parallel ones (q, k, v, gate, up: A replicated, B sharded) and r * (in/t + out) for
    row-parallel ones (o, down: A sharded, B replicated); MoE layers' MLPs are never adapted."""
    h, f, r = shape.hidden, shape.ffn, lora.rank
    col = {"q_proj": (h, shape.qd), "k_proj": (h, shape.kvd), "v_proj": (h, shape.kvd), "gate_proj": (h, f),
           "up_proj": (h, f)}
    row = {"o_proj": (shape.qd, h), "down_proj": (f, h)}
    per = shape.layers // pp
    n = 0
    for i in range(stage * per, (stage + 1) * per):
        for t in lora.target_modules:
            if t in ("gate_proj", "up_proj", "down_proj") and i in shape.moe_layers:
                continue
            if t in col:
                n += r * (col[t][0] + col[t][1] // tp)
            elif t in row:
                n += r * (row[t][0] // tp + row[t][1])
    return n


def _megatron_state(pin: PlanInput, lay, p: int, dense: float, expert: float, prefix: str) -> list[Item]:
    """Weights, fp32 main gradients and Adam state (12 B/param with bf16 weights: fp32 main
    copy + 2 moments; 8 B with fp32) of ``dense`` + ``expert`` parameters on one rank."""
    n = dense + expert
    per = 12 if p == 2 else 8
    if pin.trainer.distributed_optimizer:
        opt = per * (dense / (lay.dp * lay.cp) + expert / lay.edp)
        how = f"{per} B/param over DP*CP={lay.dp * lay.cp}" + (f", experts over EDP={lay.edp}" if expert else "")
    else:
        opt, how = per * n, f"{per} B/param, not distributed"
    return [Item((prefix or "trainer ") + "weights", p * n, "trainer", f"{n / 1e9:.3f} B params x {p} B"),
            Item(prefix + "gradients (fp32 main grad)", 4.0 * n, "trainer", "4 B/param"),
            Item(prefix + "optimizer (Adam)", opt, "trainer", how)]


def reference(pin: PlanInput, shape, lay, stage: int, mode: str) -> list[Item]:
    if mode != "grpo" or pin.max_steps == 0 or pin.grpo.beta <= 0 or pin.trainer.ref_device == "cpu":
        return []
    if pin.model.lora is not None:  # the reference is the base with the adapters off: no second copy
        return []
    p = dtype_bytes(pin.model.dtype)
    if lay.backend == "megatron":
        sp = shape.stage_params(lay.tp, lay.pp, stage, lay.ep, lay.etp)
        n = sum(sp.values())
    else:
        n = shape.hf_params()
    return [Item("reference model", p * n, "trainer", "grpo.beta > 0, trainer.ref_device same")]


# ----------------------------------------------------------------------------------- activations
def layer_bytes(shape, p: int, spec: str, tp: int, sp: bool, recompute: str, moe: bool) -> tuple[float, float]:
    """(saved, full) activation bytes of one layer per local token (see module docstring)."""
    h, qd, kvd = shape.hidden, shape.qd, shape.kvd
    n = p if spec == "te" else 4 + p
    seq_div = tp if sp else 1
    R = 2 * n * h + 2 * p * h
    A = p * (qd + 2 * kvd) + p * (qd + kvd) + (n * (qd + kvd) if shape.qk_norm else 0)
    o = (1 if spec == "te" else 2) * p * qd
    lse = 4 * shape.heads
    expert = 0.0
    if moe:
        R += 4 * shape.experts
        expert = shape.topk * (2 * p * h + 3 * p * shape.expert_ffn / tp)
        A += 3 * p * shape.shared_ffn
    else:
        A += (4 if spec == "hf" else 3) * p * shape.ffn
    full = R / seq_div + (A + o + lse) / tp + expert
    if recompute == "selective":
        saved = R / seq_div + (A + (p * qd if spec != "te" else o)) / tp + expert
    elif recompute == "full":
        saved = p * h / seq_div
    else:
        saved = full
    return saved, full


def activations(pin: PlanInput, shape, lay, stage: int, seq: int, rows: int, n_micro: int, loss_b: int,
                head_tokens: float | None = None) -> list[Item]:
    """Activation and loss items of one pipeline stage for micro-batches of ``rows`` rows of ``seq``
    tokens (forward + backward peak); ``head_tokens``: the positions of a micro-batch whose logits are
    computed when not all of them (:func:`head_positions`)."""
    p = dtype_bytes(pin.model.dtype)
    c = lay.cp
    seq_pad = math.ceil(seq / (2 * c)) * 2 * c if c > 1 else seq
    s = rows * seq_pad / c  # tokens of one micro-batch on this rank
    spec = lay.spec
    recompute = pin.trainer.recompute if lay.backend == "megatron" else ("full" if pin.trainer.gradient_checkpointing else "none")
    per_stage = shape.layers // lay.pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    saved = full_max = 0.0
    for i in layers:
        sv, fl = layer_bytes(shape, p, spec, lay.tp, lay.sp, recompute, i in shape.moe_layers)
        saved += sv
        full_max = max(full_max, fl)
    in_flight = min(lay.pp - stage, n_micro) if lay.pp > 1 else 1
    act = s * saved * in_flight
    note = f"{s:.0f} tokens x {saved / per_stage:.0f} B/token/layer x {per_stage} layers" + (f" x {in_flight} micro-batches in flight" if in_flight > 1 else "")
    items = [Item(f"activations (recompute {recompute})", act, "trainer", note)]
    if recompute == "full":
        items.append(Item("one layer recomputed in backward", s * full_max, "trainer", "full recompute"))
    if spec == "torch" and c > 1:
        mask = (1 + p) * rows * (seq_pad / c) * seq_pad * per_stage
        kv = 2 * p * (shape.qd if shape.heads != shape.kv_heads else shape.kvd) * c / lay.tp * s * per_stage
        items.append(Item("CP all-gathered K/V + attention masks", mask + kv, "trainer", "torch spec with context parallelism"))
    if spec == "hf":  # padded rows: a [b, 1, T, T] boolean mask per layer
        items.append(Item("padding masks", rows * seq * seq * per_stage * in_flight, "trainer", "b*T^2 B per layer"))
    if stage == lay.pp - 1:
        vloc = (shape.padded_vocab(lay.tp) if lay.backend == "megatron" else shape.vocab) / lay.tp
        n = p if spec == "te" else 4 + p
        head = s * (n + p) * shape.hidden / (lay.tp if lay.sp else 1)
        if head_tokens is None:
            items.append(Item("logits / logprob buffers", s * vloc * loss_b + head, "trainer",
                              f"{s:.0f} tokens x {vloc:.0f} vocab cols x {loss_b} B (vocab-parallel)"))
        else:  # the trained positions' hidden states gathered, then the head on them alone
            gathered = head_tokens * p * shape.hidden
            items.append(Item("logits / logprob buffers", head_tokens * vloc * loss_b + head + gathered, "trainer",
                              f"{head_tokens:.0f} trained positions x {vloc:.0f} vocab cols x {loss_b} B"))
    return items


def work_items(pin: PlanInput, shape, lay, stage: int, mode: str) -> list[Item]:
    """Activations and loss buffers of a train (``grpo``) or SFT step, plus the optimizer step's
    temporary where it exceeds them (see module docstring)."""
    seq, rows, nm = micro_batches(pin, lay, mode)
    items = activations(pin, shape, lay, stage, seq, rows, nm, loss_bytes(pin, mode, lay.backend),
                        head_positions(pin, lay, mode, seq, rows))
    if lay.backend == "megatron":
        if lay.spec == "te" or importlib.util.find_spec("transformer_engine") is not None:
            return items  # TE's fused Adam: no temporaries
        sp = shape.stage_params(lay.tp, lay.pp, stage, lay.ep, lay.etp)
        dense = sp["dense"] + sp["embedding"] + sp["output"]
        n = dense / (lay.dp * lay.cp) + sp["expert"] / lay.edp if pin.trainer.distributed_optimizer else dense + sp["expert"]
        step = 4.0 * n
    else:
        step = float(dtype_bytes(pin.model.dtype) * shape.hf_params())
    extra = step - sum(i.bytes for i in items)
    if extra > 0:
        items.append(Item("optimizer step temporaries (beyond the activations)", extra, "trainer",
                          "PyTorch foreach Adam: sqrt of the second moment"))
    return items


def head_positions(pin: PlanInput, lay, mode: str, seq: int, rows: int) -> float | None:
    """Positions of a micro-batch whose logits the torch backend's RL step computes with
    ``trainer.head_positions: trained`` (at most ``rows * min(seq, rollout.max_new_tokens)``); None
    where every position's are (SFT, "all", megatron)."""
    if lay.backend != "torch" or mode != "grpo" or pin.trainer.head_positions != "trained":
        return None
    return float(rows * min(seq, pin.rollout.max_new_tokens))


def loss_bytes(pin: PlanInput, mode: str, backend: str = "torch") -> int:
    """Bytes per token and local vocabulary column of the loss (see module docstring)."""
    if backend == "megatron" and pin.trainer.fused_logprobs is not False:  # the planner plans GPUs: null = on
        p = dtype_bytes(pin.model.dtype)
        return 2 * p + (p if mode == "grpo" and pin.grpo.temperature != 1.0 else 0)
    return LOSS_BYTES_ENTROPY if mode == "grpo" and pin.algo.entropy_coef != 0 else LOSS_BYTES_FWD


def micro_batches(pin: PlanInput, lay, mode: str) -> tuple[int, int, int]:
    """(sequence length, rows per micro-batch, micro-batches per DP rank per optimizer step). Rows are
    planned at full length; with trainer.micro_batch_tokens, ceil(budget / length) of them (the budget
    rounded up to whole rows: never below what a micro-batch of that budget holds)."""
    t = pin.trainer
    if mode == "sft":
        seq, seqs, minis = pin.sft.max_len, pin.sft.batch_size, 1
    else:
        seq, seqs, minis = pin.data.max_prompt_len + pin.rollout.max_new_tokens, pin.rollout.batch_size * pin.grpo.n_samples, t.mini_batches
    per_rank = math.ceil(seqs / minis / lay.dp)
    rows = max(1, min(t.micro_batch_size, per_rank))
    if t.micro_batch_tokens:  # full-length rows within the budget, rounded up: at most one row's tokens over it
        rows = max(1, min(rows, math.ceil(t.micro_batch_tokens / seq)))
    return seq, rows, math.ceil(per_rank / rows)


# ----------------------------------------------------------------------------------------- engines
def engine_items(pin: PlanInput, shape, lay, memory: float) -> tuple[list[Item], list[Item], dict]:
    """(rollout items, items left during training, KV facts) of one GPU holding an engine rank."""
    r = pin.rollout
    p = dtype_bytes(pin.engine_dtype)
    n = shape.hf_params()
    args = server_flags(r.extra_args)
    seqs = r.batch_size * pin.grpo.n_samples * (pin.loop.oversample if pin.algo.dynamic_sampling else 1.0)
    P, N = pin.data.max_prompt_len, r.max_new_tokens
    ffn = shape.topk * shape.expert_ffn + shape.shared_ffn if shape.is_moe else shape.ffn
    if engine_kind(lay.engine).memory == "sglang":
        etp = lay.engine_tp
        w = p * n / etp
        kvb = 1 if "fp8" in str(_extra_arg(args, "--kv-cache-dtype", "auto")) else p
        per_tok = 2 * shape.layers * max(shape.kv_heads / etp, 1) * shape.head_dim * kvb
        static = r.mem_fraction * memory
        kv = static - w
        max_bs = _graph_max_bs(args)
        width = 4 * shape.hidden + (shape.qd + 2 * shape.kvd) / etp + 3 * ffn / etp
        graphs = (SGLANG_GRAPH_BASE + max_bs * (4 * shape.padded_vocab(1) / etp + p * width)) if max_bs else 0.0
        chunk = _extra_arg(args, "--chunked-prefill-size", SGLANG_DEFAULT_CHUNK)
        work = chunk * p * (2 * shape.hidden + (shape.qd + 2 * shape.kvd) / etp + 3 * ffn / etp) + 8 * max(max_bs, 1) * shape.vocab
        roll = [Item("engine weights", w, "engine", f"{n / 1e9:.3f} B params x {p} B / engine TP {etp}"),
                Item("KV cache", max(kv, 0.0), "engine", f"rollout.mem_fraction {r.mem_fraction} x {memory / GiB:.1f} GiB - weights"),
                Item("CUDA graphs", graphs, "engine", f"max batch {max_bs}"),
                Item("engine prefill workspace", work, "engine", f"chunk {chunk} tokens")]
        kvinfo = {"kv_bytes_per_token": per_tok, "capacity_tokens": int(max(kv, 0) // per_tok),
                  "demand_tokens": int(seqs / max(lay.num_engines, 1) * (P + N)), "sequence_tokens": P + N,
                  "kv_gib": kv / GiB}
        return roll, [Item("engine CUDA graphs (not released)", graphs, "engine", "the loop releases weights and kv_cache only")], kvinfo
    # embedded / embedded_server: a Hugging Face model, TP 1
    B = int(min(r.engine_batch_size, math.ceil(seqs / max(lay.num_engines, 1))))
    per_tok = 2 * shape.layers * shape.kv_heads * shape.head_dim * p
    w = p * n
    kv_end = B * (P + N) * per_tok * (1 + 1 / shape.layers)
    prefill = B * P * (per_tok + shape.vocab * p + p * (2 * shape.hidden + shape.qd + 2 * shape.kvd + 4 * ffn) + P)
    decode = kv_end + B * shape.vocab * (p + 29)
    roll = [Item("engine weights", w, "engine", f"{n / 1e9:.3f} B params x {p} B (HF model)")]
    if prefill >= decode:
        roll.append(Item("prefill: KV + logits of every prompt position", prefill, "engine", f"{B} rows x {P} prompt tokens"))
    else:
        roll.append(Item("KV cache (DynamicCache) + sampling", decode, "engine", f"{B} rows x {P + N} tokens"))
    kvinfo = {"kv_bytes_per_token": per_tok, "capacity_tokens": None, "demand_tokens": int(B * (P + N)),
              "sequence_tokens": P + N, "kv_gib": B * (P + N) * per_tok / GiB, "engine_batch": B}
    return roll, [], kvinfo
