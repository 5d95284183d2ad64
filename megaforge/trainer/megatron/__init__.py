"""The Megatron-Core trainer backend: ``MegatronTrainer`` (see :mod:`.trainer`).

Modules: :mod:`.model` (GPTModel from an HF config, weight loading), :mod:`.layers` (the ``torch``
layer spec's RMSNorm and SDPA attention with packing and context parallelism), :mod:`.packing`,
:mod:`.logprobs` (vocab-parallel logprobs / entropy), :mod:`.checkpoint`, :mod:`.hf_export`,
:mod:`.cpu_compat` (patches applied only on CPU).
"""
from megaforge.trainer.megatron.trainer import MegatronTrainer  # noqa: F401
