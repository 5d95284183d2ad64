"""Megatron <-> Hugging Face names, layouts and shards, per model family; pure functions.

* :mod:`~megaforge.convert.layouts`: tensor layouts (fused qkv, gate/up, padded vocabulary) and
  their TP split / merge, registered by name.
* :mod:`~megaforge.convert.families`: per-family tables (Llama, Qwen2, Qwen3, Qwen3-MoE with
  experts / expert parallelism) and HF config -> :class:`~megaforge.convert.families.ModelDesc`.
* :mod:`~megaforge.convert.mapping`: apply a table row to tensors; :class:`HFSource` reads HF weights.
* :mod:`~megaforge.convert.hf_writer`: HF safetensors directories (sharded + index) written
  atomically; shared by both trainer backends and the tools.
* :mod:`~megaforge.convert.ranks`: conversion layouts and the CLIs' ranks (spawned, or under torchrun).
* :mod:`~megaforge.convert.lora_names`: the Megatron backend's LoRA adapter names per layout <-> PEFT
  names, and their TP shards.

The Megatron side (live bucket iterator, offline conversion) is in
:mod:`megaforge.trainer.megatron.hf_export` and :mod:`megaforge.trainer.megatron.convert`.
"""
