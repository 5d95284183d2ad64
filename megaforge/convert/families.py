"""Per-family Hugging Face <-> Megatron-Core parameter tables (Llama, Qwen2, Qwen3, Qwen3-MoE).

A :class:`Family` says which HF ``model_type`` values it covers, how its HF config becomes a
Megatron ``TransformerConfig`` / ``GPTModel`` description (:class:`ModelDesc`), and which
parameters map to which, as rows ``(megatron name, HF names, layout)``; ``{i}`` in a name is the
*global* layer index and ``{e}`` the *global* expert index. Layouts are in
:mod:`megaforge.convert.layouts`. A new family is a new table and a :func:`register_family` call.

Mixture of experts (Qwen3-MoE). A MoE layer ``i`` has, besides attention and norms:

* ``decoder.layers.{i}.mlp.router.weight`` [E, H] <- ``model.layers.{i}.mlp.gate.weight`` (replicated);
* per expert ``e`` (SequentialMLP): ``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight``
  [2 F_e, H] <- ``mlp.experts.{e}.gate_proj`` / ``up_proj`` (``gate_up``) and ``...linear_fc2.weight``
  [H, F_e] <- ``mlp.experts.{e}.down_proj`` (``row``).

Expert rows carry ``ParamMap.expert`` (global index). Expert parallelism (EP) gives EP rank ``r``
experts ``[r E/EP, (r+1) E/EP)``, renumbered from 0 locally; expert weights are split over the
*expert* tensor-parallel group (ETP, megatron's default ETP = TP), not the dense TP group. Layers in
HF's ``mlp_only_layers`` (or off the ``decoder_sparse_step`` grid) are dense (Llama MLP rows with
``intermediate_size``). On disk HF keeps one tensor per expert (transformers 5 fuses them into
``mlp.experts.gate_up_proj`` [E, 2 F_e, H] at load time and splits them again on save).

Megatron names are those of ``GPTModel`` built with megaforge's ``torch`` layer spec (megatron-core
local layers). The ``te`` spec fuses the pre-attention / pre-MLP norms into the following linear
layers; :func:`spec_name` renames for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megaforge.convert.layouts import Dims, padded_vocab_size
from megaforge.model_families import model_family


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    layout: str
    layer: Optional[int] = None  # global transformer layer index (None: embedding / head / final norm)
    export: bool = True  # False: a copy of another row's HF tensor (tied output layer), not exported
    expert: Optional[int] = None  # global expert index (MoE expert weights: EP- and ETP-sharded)


@dataclass
class ModelDesc:
    """What megaforge needs to build the Megatron model of an HF config."""

    family: str
    num_layers: int
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: Optional[dict] = None
    # --- mixture of experts (num_experts == 0: dense) ---
    num_experts: int = 0
    moe_ffn: int = 0  # expert FFN size F_e
    topk: int = 0  # experts per token
    norm_topk_prob: bool = True  # renormalise the top-k routing probabilities to sum to 1
    moe_layers: tuple = ()  # per global layer: True = MoE MLP, False = dense MLP

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and bool(self.moe_layers[i])

    def dims(self, padded_vocab: int) -> Dims:
        return Dims(self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.ffn, self.vocab, padded_vocab)

    def padded_vocab(self, divisible_by: int, tp: int) -> int:
        return padded_vocab_size(self.vocab, divisible_by, tp)


def _get(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    if theta is None:
        theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        raise ValueError(f"HF config of model_type {cfg.model_type!r} has no rope_theta")
    return float(theta)


def rope_scaling(cfg) -> Optional[dict]:
    """None for plain RoPE; the HF rope parameters dict otherwise (validated by the model builder)."""
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else "default"
    return None if kind in (None, "default") else dict(rp)


def describe_dense(cfg, family: str) -> ModelDesc:
    """ModelDesc of a dense decoder-only HF config (Llama-style attribute names); the family's q/k/v
    biases and q/k norms are those megaforge.model_families records for it."""
    facts = model_family(family)
    qkv_bias, qk_norm = facts.qkv_bias, facts.qk_norm
    heads = cfg.num_attention_heads
    if getattr(cfg, "mlp_bias", False):
        raise NotImplementedError(f"{family}: mlp_bias=True is not supported")
    if facts.o_bias and getattr(cfg, "attention_bias", False):
        raise NotImplementedError(f"{family}: attention_bias=True (biased o_proj) is not supported")
    if getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError(f"{family}: sliding-window attention is not supported")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"{family}: hidden_act={act!r} (only silu / SwiGLU)")
    return ModelDesc(
        family=family,
        num_layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size,
        num_heads=heads,
        num_kv_heads=_get(cfg, "num_key_value_heads", default=heads),
        head_dim=_get(cfg, "head_dim", default=cfg.hidden_size // heads),
        vocab=cfg.vocab_size,
        rope_theta=rope_theta(cfg),
        norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=_get(cfg, "max_position_embeddings", default=4096),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        rope_scaling=rope_scaling(cfg),
    )


# --- mapping tables ----------------------------------------------------------------------------
_L = "model.layers.{i}."
_M = "decoder.layers.{i}."
ATTENTION = [
    (_M + "input_layernorm.weight", (_L + "input_layernorm.weight",), "replicated"),
    (_M + "self_attention.linear_qkv.weight",
     (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"), "qkv"),
    (_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), "row"),
    (_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), "replicated"),
]
DENSE_MLP = [
    (_M + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "gate_up"),
    (_M + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), "row"),
]
LLAMA_LAYER = ATTENTION + DENSE_MLP
#: a MoE layer's router (once per layer) and expert rows (once per expert ``{e}``)
MOE_ROUTER = [(_M + "mlp.router.weight", (_L + "mlp.gate.weight",), "replicated")]
_X = _M + "mlp.experts.local_experts.{e}."
_HX = _L + "mlp.experts.{e}."
MOE_EXPERT = [
    (_X + "linear_fc1.weight", (_HX + "gate_proj.weight", _HX + "up_proj.weight"), "gate_up"),
    (_X + "linear_fc2.weight", (_HX + "down_proj.weight",), "row"),
]
QKV_BIAS = [
    (_M + "self_attention.linear_qkv.bias",
     (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"), "qkv"),
]
QK_NORM = [
    (_M + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",), "replicated"),
    (_M + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",), "replicated"),
]
EMBED = ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
FINAL_NORM = ("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
LM_HEAD = ("output_layer.weight", ("lm_head.weight",), "vocab")

#: renames of the ``te`` layer spec (norms fused into the next linear layer)
TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def spec_name(name: str, spec: str, moe_layer: bool = False) -> str:
    """The Megatron parameter name under layer spec ``spec`` (``torch`` or ``te``). MoE layers keep
    their own ``pre_mlp_layernorm`` under ``te`` (megatron does not fuse it into the router)."""
    if spec != "te":
        return name
    for a, b in TE_RENAMES.items():
        if name.endswith("." + a) and not (moe_layer and a.startswith("pre_mlp")):
            return name[: -len(a)] + b
    return name


def split_fused_experts(state_dict: dict) -> dict:
    """An in-memory transformers 5 state dict with the per-expert tensors its checkpoints store:
    ``...mlp.experts.gate_up_proj`` [E, 2 F_e, H] (rows: gate, then up) becomes
    ``...mlp.experts.{e}.gate_proj.weight`` / ``up_proj.weight`` [F_e, H] and ``...mlp.experts.down_proj``
    [E, H, F_e] becomes ``...mlp.experts.{e}.down_proj.weight`` [H, F_e], each a view; every other
    tensor is passed through. (transformers fuses the experts at load time and splits them on save.)"""
    out = {}
    for k, v in state_dict.items():
        if k.endswith("mlp.experts.gate_up_proj") and v.dim() == 3:
            head, f = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{head}{e}.gate_proj.weight"], out[f"{head}{e}.up_proj.weight"] = v[e, :f], v[e, f:]
        elif k.endswith("mlp.experts.down_proj") and v.dim() == 3:
            head = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{head}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def grouped_expert_name(name: str) -> str:
    """A SequentialMLP expert parameter's name as megatron's TEGroupedMLP names it: local expert
    ``k``'s ``mlp.experts.local_experts.{k}.linear_fcN.weight`` is the grouped linear layer's
    ``mlp.experts.linear_fcN.weight{k}`` (one GroupedLinear per projection holds every local expert;
    its dist-checkpoint keys are SequentialMLP's, so checkpoints do not change)."""
    head, sep, tail = name.partition("mlp.experts.local_experts.")
    if not sep:
        return name
    k, _, rest = tail.partition(".")
    proj, _, what = rest.rpartition(".")
    if not k.isdigit() or proj not in ("linear_fc1", "linear_fc2") or what not in ("weight", "bias"):
        raise ValueError(f"{name}: not a SequentialMLP expert parameter (mlp.experts.local_experts.K.linear_fcN.weight)")
    return f"{head}mlp.experts.{proj}.{what}{k}"


#: dist-checkpoint key of a MoE layer's pre-MLP norm under each layer spec: megatron's local spec
#: maps every layer's norms to TE's fused names (``self_attention.linear_qkv.layer_norm_weight``,
#: ``mlp.linear_fc1.layer_norm_weight``) so dense checkpoints agree across specs, but the TE spec
#: keeps a MoE layer's separate ``pre_mlp_layernorm`` under its own name.
MOE_PRE_MLP_NORM_KEY = {"torch": "mlp.linear_fc1.layer_norm_weight", "te": "pre_mlp_layernorm.weight"}


def checkpoint_key_to_spec(key: str, src: str, dst: str, is_moe_layer: Callable[[int], bool]) -> str:
    """A dist-checkpoint key (``decoder.layers.{i}. ...``, global layer index) as written under
    layer spec ``src``, renamed to how spec ``dst`` writes it (only MoE layers' pre-MLP norm
    differs, see :data:`MOE_PRE_MLP_NORM_KEY`)."""
    if src == dst or not key.startswith("decoder.layers."):
        return key
    i = key.split(".")[2]
    head = f"decoder.layers.{i}."
    if i.isdigit() and is_moe_layer(int(i)) and key == head + MOE_PRE_MLP_NORM_KEY[src]:
        return head + MOE_PRE_MLP_NORM_KEY[dst]
    return key


@dataclass
class Family:
    name: str
    model_types: tuple[str, ...]
    describe: Callable[[Any], ModelDesc]
    layer_rows: list = field(default_factory=list)
    # MoE families: rows of a dense layer's MLP, of a MoE layer's router and of one expert ({e})
    dense_rows: list = field(default_factory=list)
    router_rows: list = field(default_factory=list)
    expert_rows: list = field(default_factory=list)

    def layer_param_maps(self, desc: ModelDesc, i: int) -> list[ParamMap]:
        """Rows of global layer ``i``: ``layer_rows``, then (MoE layer) the router and every expert
        ``e = 0..E-1`` in order, or (dense layer of a MoE family) ``dense_rows``."""
        rows = [ParamMap(m.format(i=i), tuple(h.format(i=i) for h in hf), layout, layer=i)
                for m, hf, layout in self.layer_rows]
        if not desc.is_moe:
            return rows
        if not desc.is_moe_layer(i):
            return rows + [ParamMap(m.format(i=i), tuple(h.format(i=i) for h in hf), layout, layer=i)
                           for m, hf, layout in self.dense_rows]
        rows += [ParamMap(m.format(i=i), tuple(h.format(i=i) for h in hf), layout, layer=i)
                 for m, hf, layout in self.router_rows]
        for e in range(desc.num_experts):
            rows += [ParamMap(m.format(i=i, e=e), tuple(h.format(i=i, e=e) for h in hf), layout, layer=i, expert=e)
                     for m, hf, layout in self.expert_rows]
        return rows

    def param_maps(self, desc: ModelDesc) -> list[ParamMap]:
        """Every Megatron parameter of the whole model in a fixed order: embedding, layers 0..L-1,
        final norm, output layer. With tied embeddings the output layer row reads the embedding's
        HF tensor and is not exported (the last pipeline stage keeps its own copy)."""
        rows = [ParamMap(EMBED[0], EMBED[1], EMBED[2])]
        for i in range(desc.num_layers):
            rows += self.layer_param_maps(desc, i)
        rows.append(ParamMap(*FINAL_NORM))
        if desc.tied:
            rows.append(ParamMap(LM_HEAD[0], EMBED[1], "vocab", export=False))
        else:
            rows.append(ParamMap(*LM_HEAD))
        return rows


FAMILIES: dict[str, Family] = {}


def register_family(f: Family) -> Family:
    FAMILIES[f.name] = f
    return f


register_family(Family("llama", ("llama",), lambda c: describe_dense(c, "llama"), LLAMA_LAYER))
register_family(Family("qwen2", ("qwen2",), lambda c: describe_dense(c, "qwen2"), LLAMA_LAYER + QKV_BIAS))
register_family(Family("qwen3", ("qwen3",), lambda c: describe_dense(c, "qwen3"), LLAMA_LAYER + QK_NORM))


def describe_qwen3_moe(cfg) -> ModelDesc:
    """Qwen3-MoE: Qwen3 attention (q/k norm, no bias); layer i is MoE unless i is in
    ``mlp_only_layers`` or (i + 1) is not a multiple of ``decoder_sparse_step``. Routing: softmax
    over all experts, top-k, renormalised when ``norm_topk_prob``; no shared experts."""
    desc = describe_dense(cfg, "qwen3_moe")
    E = int(getattr(cfg, "num_experts", 0) or 0)
    if E <= 0:
        raise NotImplementedError("qwen3_moe: num_experts must be > 0")
    only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    desc.num_experts = E
    desc.moe_ffn = int(cfg.moe_intermediate_size)
    desc.topk = int(cfg.num_experts_per_tok)
    desc.norm_topk_prob = bool(getattr(cfg, "norm_topk_prob", False))
    desc.moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(desc.num_layers))
    return desc


register_family(Family("qwen3_moe", ("qwen3_moe",), describe_qwen3_moe, ATTENTION + QK_NORM,
                       dense_rows=DENSE_MLP, router_rows=MOE_ROUTER, expert_rows=MOE_EXPERT))


def family_of(hf_config) -> Family:
    mt = getattr(hf_config, "model_type", None)
    for f in FAMILIES.values():
        if mt in f.model_types:
            return f
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise NotImplementedError(f"HF model_type {mt!r} has no megaforge family; supported: {known}")
