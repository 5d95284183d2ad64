"""Model families: one entry per Hugging Face ``model_type`` holding what megaforge's modules need to
know about it, read from here by the planner (megaforge.planner.shapes), the megatron converter's
model description (megaforge.convert.families), the embedded engine's fast path
(megaforge.rollout.embedded.fast.forward) and the torch trainer's split LM head
(megaforge.trainer.causal_lm).

    MODEL_FAMILIES.register("my_llama", ModelFamily(fast_decode=True))

A new family with Llama-style HF modules is this one registration (here, or from a plug-in module
imported before the model is read); the megatron backend also needs the family's parameter table
(megaforge.convert.families.register_family), which ``megatron`` declares. SGLang's weight checks
(megaforge.sync.sglang_checksum) map tensors by their names, with no per-family switch.

This module is pure data (no torch): the planner reads it on a login node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaforge.registry import Registry


@dataclass(frozen=True)
class ModelFamily:
    """The facts of one HF ``model_type`` (a Llama-style decoder: RMSNorm, rotary attention, SwiGLU MLP)."""

    qkv_bias: bool = False
    """The q/k/v projections always carry biases (Qwen2); else they do when the HF config sets
    ``attention_bias``."""
    o_bias: bool = True
    """The output projection carries a bias when the HF config sets ``attention_bias`` (Qwen2's never)."""
    qk_norm: bool = False
    """RMSNorm over each query / key head before the rotary embedding (Qwen3)."""
    moe: bool = False
    """Mixture-of-experts MLPs (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ...)."""
    megatron: bool = False
    """megaforge's megatron backend has its parameter table (megaforge.convert.families)."""
    split_head: bool = True
    """Its CausalLM logits are ``lm_head(model(...).last_hidden_state)``, nothing more (no logit scaling
    or soft-capping; router aux losses only with labels): ``trainer.head_positions: trained`` may run
    the decoder and the head apart."""
    fast_decode: bool = False
    """The embedded engine's fast path (static KV cache, CUDA graphs; megaforge.rollout.embedded.fast)
    runs its dense Llama-style layers."""


MODEL_FAMILIES = Registry("model family")


def model_family(model_type: Optional[str]) -> Optional[ModelFamily]:
    """The entry of ``model_type`` (None for a type megaforge does not know)."""
    return MODEL_FAMILIES.get(model_type) if model_type in MODEL_FAMILIES else None


def model_types(**facts) -> list[str]:
    """The registered model types, sorted; with ``facts`` (e.g. ``fast_decode=True``) those whose
    entry has them."""
    return [t for t in MODEL_FAMILIES.names() if all(getattr(MODEL_FAMILIES.get(t), k) == v for k, v in facts.items())]


MODEL_FAMILIES.register("llama", ModelFamily(megatron=True, fast_decode=True))
MODEL_FAMILIES.register("mistral", ModelFamily(split_head=False))
MODEL_FAMILIES.register("qwen2", ModelFamily(qkv_bias=True, o_bias=False, megatron=True, fast_decode=True))
MODEL_FAMILIES.register("qwen3", ModelFamily(qk_norm=True, megatron=True, fast_decode=True))
MODEL_FAMILIES.register("qwen2_moe", ModelFamily(qkv_bias=True, o_bias=False, moe=True))
MODEL_FAMILIES.register("qwen3_moe", ModelFamily(qk_norm=True, moe=True, megatron=True))
