"""Config sections of the policy model and its prompt data (``model:``, ``data:``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megaforge.configtree import bounded

DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy (``model.lora``; null: full fine-tuning). A targeted linear layer
    y = x W^T becomes

        y = x W^T + (alpha / rank) * dropout(x) A^T B^T      A [rank, in] (Kaiming-uniform), B [out, rank] = 0

    so the adapted policy starts equal to the base. Only A and B carry gradients and optimizer state;
    W stays frozen (bit-equal over the run). The engines get the merged weight W + (alpha / rank) B A
    through the weight sync; checkpoints hold the adapters and their optimizer state."""

    rank: int = bounded(8, ge=1)
    """Rank r of each adapter (A is [r, in], B is [out, r])."""
    alpha: float = bounded(16.0, gt=0)
    """Scale numerator: the adapter's update is multiplied by alpha / rank."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapter's input x (training forwards only; 0: none, and then the merged weights
    equal the adapted forward exactly)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get adapters, by the last part of their module name (``q_proj`` matches every
    layer's ``self_attn.q_proj``), or a full dotted name (torch backend). Each entry must match at least
    one module. The megatron backend takes the HF projection names q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj (adapting their slices of megatron's fused qkv / gate-up linears)."""


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model directory or hub id of the policy's initial weights. Empty: random init
    from ``model.config`` (seeded by ``model.init_seed``)."""
    config: str = ""
    """HF ``config.json`` (file or directory) used for random init when ``model.path`` is empty."""
    tokenizer: str = ""
    """Tokenizer directory or hub id; defaults to ``model.path``."""
    dtype: DType = "float32"
    """Parameter and compute dtype of the trainer and the embedded engine."""
    init_seed: int = 0
    """Seed of the random init (only with ``model.config``)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation for HF modules (sdpa, eager, flex_attention)."""
    trust_remote_code: bool = False
    """Passed to transformers; only enable for model code you trust."""
    lora: Optional[LoraConfig] = None
    """Low-rank adapters (``{rank, alpha, dropout, target_modules}``); null: full fine-tuning. Torch backend:
    PEFT; megatron backend: tensor-parallel adapters on megatron's linears (torch layer spec, no FP8, HF
    projection names as targets, MoE experts not targeted; megaforge.trainer.megatron.lora)."""


@dataclass
class DataConfig:
    path: str = ""
    """Prompts: a .jsonl or .parquet file, a directory of them, a `datasets` dataset (local path or
    hub name), or a synthetic task name (``format: synthetic``, e.g. ``arithmetic``)."""
    format: Literal["auto", "jsonl", "parquet", "hf", "synthetic"] = "auto"
    """How to read ``data.path``; ``auto`` decides from the path."""
    split: str = "train"
    """Split of a `datasets` dataset."""
    name: str = ""
    """Configuration (subset) of a `datasets` hub dataset, e.g. ``main`` for openai/gsm8k or ``en`` for
    open-r1/DAPO-Math-17k-Processed; empty: the dataset's default."""
    streaming: bool = False
    """Stream a `datasets` dataset instead of loading it whole."""
    input_key: str = "prompt"
    """Row key of the prompt text, or of a list of chat messages ({role, content})."""
    label_key: str = "answer"
    """Row key of the reference answer handed to the reward functions."""
    response_key: str = "response"
    """Row key of the target response (SFT data)."""
    apply_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template (user turn + generation prompt)."""
    system_prompt: str = ""
    """System message prepended to every chat prompt (empty: none)."""
    max_prompt_len: int = 512
    """Prompts longer than this many tokens are an error naming the row (or skipped, see below)."""
    shuffle: bool = True
    """Shuffle the rows each epoch with the run's seed (map-style data only)."""
    skip_bad_rows: bool = False
    """Skip (and count in ``data/skipped_rows``) malformed or over-long rows instead of failing."""
    synthetic_size: int = 4096
    """Rows of a synthetic task."""
    synthetic_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the synthetic task generator (e.g. ``{max_operand: 9}``)."""

