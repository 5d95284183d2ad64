"""LoRA adapter names and shards between the Megatron backend and PEFT (pure, CPU tensors, no process groups).

The Megatron backend (:mod:`megaforge.trainer.megatron.lora`) keeps one adapter per *Hugging Face
projection* ``p`` (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) on the megatron
linear that computes it (:data:`TARGETS`):

    megatron (this stage's layer j):  decoder.layers.{j}.<linear>.lora.<p>.lora_A / .lora_B
    PEFT (global layer i = j + stage offset):  base_model.model.model.layers.{i}.<self_attn|mlp>.<p>.lora_A.weight

with A [r, in] and B [out, r] in HF's shapes (out, in those of the HF projection: q_proj [nq d, H],
gate_proj [F, H], down_proj [H, F], ...). Tensor-parallel shards, as the base weight they adapt:

* column-parallel linears (linear_qkv: q/k/v, linear_fc1: gate/up): A replicated, B split along
  dim 0 (rank t holds rows [t out/tp, (t+1) out/tp)). These rows are exactly the rows of the HF
  projection that rank t's shard of the fused weight holds: the qkv layout gives rank t the whole
  key/value groups [t nkv/tp, (t+1) nkv/tp), whose q heads are HF q rows [t nq d/tp, ...) (groups
  are contiguous in HF's head order); the gate_up layout splits gate and up separately.
* row-parallel linears (linear_proj: o, linear_fc2: down): A split along dim 1 (the input features,
  as the weight), B replicated.

A checkpoint keys each adapter tensor by its PEFT name with its global shape, so it loads at any
TP x PP layout (dist-checkpointing reshards); :func:`stage_table` is the name map of one layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

#: HF projection -> (megatron linear under decoder.layers.{j}, its slot in a fused output or None,
#: parallel kind, HF parent module)
TARGETS: dict[str, tuple[str, Optional[str], str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "q", "column", "self_attn"),
    "k_proj": ("self_attention.linear_qkv", "k", "column", "self_attn"),
    "v_proj": ("self_attention.linear_qkv", "v", "column", "self_attn"),
    "o_proj": ("self_attention.linear_proj", None, "row", "self_attn"),
    "gate_proj": ("mlp.linear_fc1", "gate", "column", "mlp"),
    "up_proj": ("mlp.linear_fc1", "up", "column", "mlp"),
    "down_proj": ("mlp.linear_fc2", None, "row", "mlp"),
}
AB = ("lora_A", "lora_B")
PEFT_PREFIX = "base_model.model."


def megatron_name(layer: int, proj: str, ab: str) -> str:
    """The adapter parameter's name in this stage's GPTModel (``layer`` local to the stage)."""
    return f"decoder.layers.{layer}.{TARGETS[proj][0]}.lora.{proj}.{ab}"


def hf_module(layer: int, proj: str) -> str:
    """The HF module name of projection ``proj`` of global layer ``layer`` (``model.layers.3.self_attn.q_proj``)."""
    return f"model.layers.{layer}.{TARGETS[proj][3]}.{proj}"


def peft_name(layer: int, proj: str, ab: str) -> str:
    """PEFT's saved name (adapter_model.safetensors) of the adapter of global layer ``layer``."""
    return f"{PEFT_PREFIX}{hf_module(layer, proj)}.{ab}.weight"


def split_axis(proj: str, ab: str) -> Optional[int]:
    """The dimension the TP shards of this adapter tensor are cut along (None: replicated)."""
    kind = TARGETS[proj][2]
    if kind == "column":
        return 0 if ab == "lora_B" else None
    return 1 if ab == "lora_A" else None


def shard(full: torch.Tensor, proj: str, ab: str, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of a full (HF-shaped) adapter tensor."""
    axis = split_axis(proj, ab)
    if axis is None:
        return full.clone()
    if full.shape[axis] % tp:
        raise ValueError(f"{proj}.{ab}: dim {axis} of {tuple(full.shape)} is not divisible by tp={tp}")
    return full.chunk(tp, dim=axis)[rank].clone()


def merge(shards: Sequence[torch.Tensor], proj: str, ab: str) -> torch.Tensor:
    """The full adapter tensor from its TP shards in rank order (inverse of :func:`shard`)."""
    axis = split_axis(proj, ab)
    return shards[0].clone() if axis is None else torch.cat(list(shards), dim=axis)


@dataclass(frozen=True)
class AdapterRow:
    """One adapter tensor of one pipeline stage: its name there, its PEFT name, how it is sharded."""

    megatron: str
    peft: str
    layer: int  # global layer index
    proj: str
    ab: str
    split_axis: Optional[int]


def stage_table(num_layers: int, pp: int, stage: int, targets: Sequence[str]) -> list[AdapterRow]:
    """The adapter tensors of pipeline stage ``stage`` of ``pp`` (``num_layers / pp`` layers each,
    megatron's even split), in layer then :data:`TARGETS` order, for HF projections ``targets``."""
    if num_layers % pp:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline_parallel={pp}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; valid: {', '.join(TARGETS)}")
    per = num_layers // pp
    rows = []
    for j in range(per):
        i = stage * per + j
        for proj in TARGETS:
            if proj in targets:
                rows += [AdapterRow(megatron_name(j, proj, ab), peft_name(i, proj, ab), i, proj, ab, split_axis(proj, ab))
                         for ab in AB]
    return rows


def parse_megatron_name(name: str) -> tuple[int, str, str]:
    """(local layer, proj, ab) of a :func:`megatron_name`."""
    parts = name.split(".")
    if len(parts) < 6 or parts[0] != "decoder" or parts[1] != "layers" or parts[-3] != "lora":
        raise ValueError(f"{name!r} is not a Megatron LoRA adapter name")
    return int(parts[2]), parts[-2], parts[-1]


def to_peft(name: str, layer_offset: int) -> str:
    """The PEFT name of Megatron adapter ``name`` on a stage whose first layer is global ``layer_offset``."""
    j, proj, ab = parse_megatron_name(name)
    return peft_name(j + layer_offset, proj, ab)
