"""The Megatron-Core trainer backend: ``MegatronTrainer`` (see :mod:`.trainer`).

Modules: :mod:`.model` (GPTModel from an HF config — dense or MoE with expert parallelism —, weight
loading), :mod:`.layers` (the ``torch`` layer spec's RMSNorm and SDPA attention with packing and
context parallelism), :mod:`.packing`, :mod:`.logprobs` (vocab-parallel logprobs / entropy),
:mod:`.checkpoint` (dist checkpoints, model-only loads with checks), :mod:`.hf_export` (streaming HF
buckets, HF export), :mod:`.convert` (offline HF <-> dist-checkpoint conversion),
:mod:`.cpu_compat` (patches applied only on CPU), :mod:`.lora` (``model.lora``: tensor-parallel adapters on
megatron's linears, merged weights for the engines) and :mod:`.lora_checkpoint` (adapters-only checkpoints,
the PEFT adapter folder).
"""
from megaforge.trainer.megatron.trainer import MegatronTrainer  # noqa: F401
