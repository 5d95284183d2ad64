"""Config sections of the trainer backend (``trainer:``) and the supervised warm start (``sft:``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megaforge.config.model import DataConfig
from megaforge.configtree import bounded


@dataclass
class TrainerConfig:
    backend: Literal["torch", "megatron"] = "torch"
    """Trainer backend: torch (HF modules, DDP) or megatron (megatron-core, TP/PP/CP)."""
    device: str = "auto"
    """auto | cpu | cuda."""
    lr: float = bounded(1e-6, ge=0)
    """Peak learning rate (a negative one would ascend the loss)."""
    min_lr: float = bounded(0.0, ge=0)
    """Final learning rate of the cosine / linear schedule."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear warm-up optimizer steps."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    betas: list[float] = bounded([0.9, 0.999], ge=0, lt=1)
    """AdamW betas."""
    eps: float = bounded(1e-8, gt=0)
    """AdamW epsilon."""
    grad_clip: float = bounded(1.0, ge=0)
    """Global gradient-norm clip (0 disables)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (with micro_batch_tokens: the most a micro-batch holds)."""
    micro_batch_tokens: int = bounded(0, ge=0)
    """Token budget of a micro-batch (0: off, every micro-batch is micro_batch_size rows). When set, a
    micro-batch takes the next row while it holds at most micro_batch_size rows and at most this many
    positions: its rows' packed length on the megatron backend (rows end to end, each padded for CP
    alignment; before the CP split), rows x its longest row on the torch backend (rows sorted longest
    first). A row longer than the budget is a micro-batch alone. Fewer, fuller micro-batches for short
    rows: fewer kernel launches and host round trips per token, activation memory bounded by tokens."""
    mini_batches: int = 1
    """Optimizer steps per RL step (the batch is split into this many mini-batches)."""
    epochs: int = 1
    """Passes over the rollout batch per RL step (PPO epochs)."""
    ref_device: str = "same"
    """Where the frozen reference policy lives: same | cpu."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward."""
    autocast: Literal["off", "bfloat16"] = "off"
    """torch backend on CUDA: run the forward and backward of the decoder layers under bfloat16
    autocast (parameters, gradients and AdamW state stay in model.dtype, e.g. float32 master weights);
    the LM head and the log-softmax stay in float32, so token log-probs keep float32 resolution."""
    head_positions: Literal["trained", "all"] = "trained"
    """torch backend, RL forwards (the policy loss, pi_old and reference log-probs): run the LM head,
    log-softmax and entropy only at the positions whose token is trained (loss_mask > 0; the values
    elsewhere are 0 and read by nothing); "all": at every position, through the CausalLM's own forward
    (needed for model types other than llama / qwen2 / qwen3 and their MoE variants). SFT and
    compute_logprobs' default (parity checks) compute every position either way."""
    max_bad_steps: int = 3
    """Consecutive steps in which every optimizer update had a non-finite loss or gradient (all skipped:
    nothing learned) before the run stops. A step with some updates skipped goes on; the skipped
    updates name their gradients on stderr and are counted in health/skipped_updates
    (health/skipped_steps: steps with at least one)."""
    # --- megatron backend ---
    tensor_parallel: int = 1
    """Tensor-parallel size (megatron)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (megatron)."""
    context_parallel: int = 1
    """Context-parallel size (megatron)."""
    expert_parallel: int = 1
    """Expert-parallel size (megatron, MoE): each EP rank holds num_experts / expert_parallel experts
    and tokens reach them through megatron's all-to-all token dispatcher. EP ranks are carved out of
    the data-parallel ranks: world % (expert_tensor_parallel x expert_parallel x pipeline_parallel)
    must be 0."""
    expert_tensor_parallel: int = 1
    """Expert tensor-parallel size (megatron's expert_tensor_parallel_size, MoE): each expert's
    projections are split over this many ranks, independently of trainer.tensor_parallel (which
    splits attention and dense MLPs). Experts are laid out expert-TP x EP x expert-DP x PP, expert-DP
    = world / (expert_tensor_parallel x expert_parallel x pipeline_parallel). 1 (Megatron-LM's
    default): whole experts per rank; set it to trainer.tensor_parallel for megatron-core's own
    default (experts split like the dense MLPs)."""
    sequence_parallel: bool = False
    """Sequence parallelism (megatron, needs tensor_parallel > 1)."""
    layer_spec: Literal["auto", "te", "torch"] = "auto"
    """Transformer layer implementation (megatron): te (Transformer Engine), torch, or auto."""
    moe_experts: Literal["auto", "grouped", "sequential"] = "auto"
    """Mixture-of-experts expert layers (megatron): grouped = one grouped GEMM over a rank's local
    experts per projection (Transformer Engine's GroupedLinear through megatron's TEGroupedMLP, with
    TE's fused token permute / unpermute on GPU); sequential = one GEMM per expert (megatron's
    SequentialMLP: a loop over experts); auto = grouped under layer_spec te, sequential under torch
    (no grouped kernel without TE). grouped needs layer_spec te. Checkpoints are interchangeable."""
    fp8: Optional[Literal["hybrid", "e4m3"]] = None
    """FP8 training format (megatron + te)."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe (delayed, tensorwise, ...)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation (megatron)."""
    routing_replay: bool = True
    """With rollout.return_routed_experts (megatron, MoE): the routers take each token's top-k experts
    from the rollout engine's routing instead of choosing them (their weights over those experts still
    come from the current router logits: megatron's replay, see
    megaforge.trainer.megatron.routing_replay); false: they choose themselves and the routing is only
    compared (``routing/replay_diff_frac``)."""
    fused_logprobs: Optional[bool] = None
    """Per-token logprob/entropy over the vocabulary (megatron) through torch.compile'd kernels that
    read the bf16 logits once per pass instead of ~16 GB of float32 temporaries per 4k x 32k
    micro-batch: null = on for CUDA logits, off on CPU; true/false force it (false: eager, the same
    formulas op by op)."""


@dataclass
class SFTConfig:
    max_steps: int = 0
    """SFT optimizer steps before RL (0 skips the warm start). The SFT launcher runs only these."""
    batch_size: int = 32
    """Sequences per SFT step."""
    lr: float = bounded(1e-3, ge=0)
    """SFT learning rate (a negative one would ascend the loss)."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear warm-up of the SFT learning rate."""
    data: Optional[DataConfig] = None
    """SFT data; null: ``data`` (the RL prompts with their ``response`` targets). Rows are
    prompt/response (loss on the response and its end-of-turn token) or a chat message list under
    ``input_key`` ending with an assistant turn (loss on every assistant turn)."""
    pack: bool = True
    """Pack several examples per row (position ids restart per example and attention never crosses
    examples: transformers' position-id packing, exact for its built-in models; turn it off for
    trust_remote_code models whose attention ignores position-id restarts). Megatron always packs."""
    pack_len: int = 0
    """Row length of packed rows (torch backend); 0: the longest example of each micro-batch, so
    packing never lengthens a row and only removes padding."""
    max_len: int = 512
    """Maximum SFT sequence length."""
