"""Per-family Hugging Face <-> Megatron-Core parameter tables (Llama, Qwen2, Qwen3).

A :class:`Family` says which HF ``model_type`` values it covers, how its HF config becomes a
Megatron ``TransformerConfig`` / ``GPTModel`` description (:class:`ModelDesc`), and which
parameters map to which, as rows ``(megatron name, HF names, layout)``; ``{i}`` in a name is the
*global* layer index. Layouts are in :mod:`megaforge.convert.layouts`. A new family is a new table
and a :func:`register_family` call; MoE families add rows with new layouts.

Megatron names are those of ``GPTModel`` built with megaforge's ``torch`` layer spec (megatron-core
local layers). The ``te`` spec fuses the pre-attention / pre-MLP norms into the following linear
layers; :func:`spec_name` renames for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megaforge.convert.layouts import Dims, padded_vocab_size


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    layout: str
    layer: Optional[int] = None  # global transformer layer index (None: embedding / head / final norm)
    export: bool = True  # False: a copy of another row's HF tensor (tied output layer), not exported


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


def describe_dense(cfg, family: str, qkv_bias: bool, qk_norm: bool) -> ModelDesc:
    """ModelDesc of a dense decoder-only HF config (Llama-style attribute names)."""
    heads = cfg.num_attention_heads
    if getattr(cfg, "mlp_bias", False):
        raise NotImplementedError(f"{family}: mlp_bias=True is not supported")
    if family != "qwen2" and getattr(cfg, "attention_bias", False):
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
LLAMA_LAYER = [
    (_M + "input_layernorm.weight", (_L + "input_layernorm.weight",), "replicated"),
    (_M + "self_attention.linear_qkv.weight",
     (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"), "qkv"),
    (_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), "row"),
    (_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), "replicated"),
    (_M + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "gate_up"),
    (_M + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), "row"),
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


def spec_name(name: str, spec: str) -> str:
    """The Megatron parameter name under layer spec ``spec`` (``torch`` or ``te``)."""
    if spec != "te":
        return name
    for a, b in TE_RENAMES.items():
        if name.endswith("." + a):
            return name[: -len(a)] + b
    return name


@dataclass
class Family:
    name: str
    model_types: tuple[str, ...]
    describe: Callable[[Any], ModelDesc]
    layer_rows: list = field(default_factory=list)

    def param_maps(self, desc: ModelDesc) -> list[ParamMap]:
        """Every Megatron parameter of the whole model in a fixed order: embedding, layers 0..L-1,
        final norm, output layer. With tied embeddings the output layer row reads the embedding's
        HF tensor and is not exported (the last pipeline stage keeps its own copy)."""
        rows = [ParamMap(EMBED[0], EMBED[1], EMBED[2])]
        for i in range(desc.num_layers):
            for m, hf, layout in self.layer_rows:
                rows.append(ParamMap(m.format(i=i), tuple(h.format(i=i) for h in hf), layout, layer=i))
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


register_family(Family("llama", ("llama",), lambda c: describe_dense(c, "llama", False, False), LLAMA_LAYER))
register_family(Family("qwen2", ("qwen2",), lambda c: describe_dense(c, "qwen2", True, False), LLAMA_LAYER + QKV_BIAS))
register_family(Family("qwen3", ("qwen3",), lambda c: describe_dense(c, "qwen3", False, True), LLAMA_LAYER + QK_NORM))


def family_of(hf_config) -> Family:
    mt = getattr(hf_config, "model_type", None)
    for f in FAMILIES.values():
        if mt in f.model_types:
            return f
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise NotImplementedError(f"HF model_type {mt!r} has no megaforge family; supported: {known}")
