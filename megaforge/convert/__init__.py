"""Megatron <-> Hugging Face names, layouts and shards, per model family; pure functions.

* :mod:`~megaforge.convert.layouts`: tensor layouts (fused qkv, gate/up, padded vocabulary) and
  their TP split / merge, registered by name.
* :mod:`~megaforge.convert.families`: per-family tables (Llama, Qwen2, Qwen3) and HF config ->
  :class:`~megaforge.convert.families.ModelDesc`.
* :mod:`~megaforge.convert.mapping`: apply a table row to tensors; :class:`HFSource` reads HF weights.
"""
