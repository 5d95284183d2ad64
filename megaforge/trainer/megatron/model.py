"""Build a megatron-core ``GPTModel`` from a Hugging Face config and load HF weights into it.

Each rank builds only its pipeline stage and loads only its tensor-parallel shards, reading the HF
tensors it needs from the safetensors files (or an in-memory HF state dict for random inits).
The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * TP``; the padded rows are
zero and never scored (see :mod:`megaforge.trainer.megatron.logprobs`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megaforge.convert import families
from megaforge.convert.families import ModelDesc, ParamMap
from megaforge.convert.layouts import Dims
from megaforge.convert.mapping import HFSource, to_megatron_shard
from megaforge.hf import hf_config, load_hf_model
from megaforge.trainer.megatron.layers import RMSNorm, SDPAttention, use_document_rotary

VOCAB_DIVISIBLE_BY = 128


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import megatron.core.extensions.transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _wgrad_fusion_available() -> bool:
    """Whether apex's ``fused_weight_gradient_mlp_cuda`` imports: megatron's ColumnParallelLinear
    (the output layer, also under the TE spec) refuses ``gradient_accumulation_fusion`` without it."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_spec(setting: str) -> str:
    """``trainer.layer_spec``: auto -> te when Transformer Engine imports, else torch."""
    if setting == "auto":
        return "te" if te_available() else "torch"
    if setting == "te" and not te_available():
        raise RuntimeError("trainer.layer_spec=te but transformer_engine is not importable")
    if setting not in ("te", "torch"):
        raise ValueError(f"trainer.layer_spec={setting!r}; valid: auto, te, torch")
    return setting


def grouped_experts(setting: str, spec: str) -> bool:
    """``trainer.moe_experts`` resolved: True for one grouped GEMM over the local experts (TE's
    GroupedLinear), False for megatron's SequentialMLP (a GEMM per expert)."""
    if setting == "auto":
        return spec == "te"
    if setting == "grouped" and spec != "te":
        raise ValueError("trainer.moe_experts=grouped needs trainer.layer_spec te (Transformer Engine's GroupedLinear); "
                         "the torch spec runs experts as megatron's SequentialMLP (trainer.moe_experts sequential)")
    if setting not in ("grouped", "sequential"):
        raise ValueError(f"trainer.moe_experts={setting!r}; valid: auto, grouped, sequential")
    return setting == "grouped"


def layer_spec(spec: str, desc: ModelDesc, config):
    """Transformer-block submodules for GPTModel: one layer spec per local layer.

    ``torch``: megatron-core local layers with megaforge's RMSNorm (sequence parallel capable) and
    SDPA core attention (packed sequences, context parallel). ``te``: megatron's TE spec. MoE layers
    (``desc.is_moe_layer``) get megatron's MoE layer: TopKRouter (``mlp.router.weight``) and either
    SequentialMLP experts (``mlp.experts.local_experts.{k}.linear_fc1/2.weight``, a GEMM per expert)
    or, with ``config.moe_grouped_gemm`` (te spec only), TEGroupedMLP (``mlp.experts.linear_fc1/2.weight{k}``:
    TE's GroupedLinear, one grouped GEMM over the k = 0..E/EP-1 local experts per projection).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    def one(moe: bool):
        kw = dict(num_experts=desc.num_experts, moe_grouped_gemm=bool(config.moe_grouped_gemm)) if moe else {}
        if spec == "te":
            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=desc.qk_norm, **kw)
        ls = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=desc.qk_norm, **kw)
        sub = ls.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        att = sub.self_attention.submodules
        att.core_attention = SDPAttention
        if desc.qk_norm:
            att.q_layernorm = RMSNorm
            att.k_layernorm = RMSNorm
        return ls

    if spec == "te" and not desc.is_moe:
        return one(False)  # GPTModel adds TE's final norm
    offset = get_transformer_layer_offset(config)
    specs = [one(desc.is_moe_layer(offset + j)) for j in range(get_num_layers_to_build(config))]
    if spec == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def _fix_moe_without_te() -> None:
    """megatron-core 0.16.1 bug: without Transformer Engine, ``moe_utils`` never defines
    ``te_general_gemm`` (and the fused ops), yet the router's gating GEMM tests
    ``te_general_gemm is not None``: NameError. Define the missing names as None (the plain-torch
    branches are then taken)."""
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", True):
        return
    for n in ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
              "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
              "fused_topk_with_score_function", "fused_unpermute"):
        if not hasattr(moe_utils, n):
            setattr(moe_utils, n, None)


def moe_kwargs(desc: ModelDesc, on_cpu: bool, grouped: bool = False) -> dict:
    """TransformerConfig MoE settings equivalent to HF Qwen3-MoE routing.

    HF: p = softmax(router logits) over all E experts, top-k of p, divided by their sum when
    ``norm_topk_prob``. megatron: ``moe_router_pre_softmax=False`` takes the top-k *logits* and
    softmaxes over those k only, which equals HF's renormalised top-k probabilities (softmax is
    monotonic and shift-invariant); ``moe_router_pre_softmax=True`` softmaxes over all experts and
    keeps the top-k unnormalised (HF with ``norm_topk_prob=False``). No top-k scaling factor, no
    auxiliary / z loss (RL fine-tuning), no token dropping, router in the model dtype (as HF).
    Token dispatcher: ``alltoall`` (set for every model: megatron rejects its default ``allgather``
    with variable sequence lengths, which the trainer's packed batches need); it runs on CPU / gloo
    with cpu_compat's stream stand-ins and split-size lists. ``grouped``: experts as one grouped GEMM
    (TEGroupedMLP) and, on GPU, TE's fused permute / unpermute of the dispatched tokens.
    """
    if not desc.is_moe:
        return {}
    _fix_moe_without_te()
    return dict(
        num_moe_experts=desc.num_experts, moe_ffn_hidden_size=desc.moe_ffn, moe_router_topk=desc.topk,
        moe_router_pre_softmax=not desc.norm_topk_prob, moe_router_score_function="softmax",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_layer_freq=[int(m) for m in desc.moe_layers], moe_grouped_gemm=grouped,
        moe_permute_fusion=grouped and not on_cpu,
    )


def transformer_config(desc: ModelDesc, tcfg, dtype: torch.dtype, on_cpu: bool, spec: str):
    """megatron ``TransformerConfig`` equivalent to the HF architecture ``desc``.

    ``tcfg`` is ``cfg.trainer`` (parallel sizes, recompute, fp8). Dropout is 0 (RL fine-tuning);
    loss scaling is left to megaforge (``calculate_per_token_loss=True`` keeps megatron from
    dividing micro-batch losses, see the trainer).
    """
    from megatron.core.transformer import TransformerConfig

    if tcfg.expert_parallel > 1 and not desc.is_moe:
        raise ValueError(f"trainer.expert_parallel={tcfg.expert_parallel} needs a mixture-of-experts model ({desc.family} has no experts)")
    if desc.is_moe and desc.num_experts % tcfg.expert_parallel:
        raise ValueError(f"num_experts={desc.num_experts} is not divisible by trainer.expert_parallel={tcfg.expert_parallel}")
    etp = getattr(tcfg, "expert_tensor_parallel", None)  # dense models: unused (saved layouts record TP there)
    etp = tcfg.tensor_parallel if etp is None else etp  # converter layouts: None = TP
    if desc.is_moe and desc.moe_ffn % etp:
        raise ValueError(f"moe_intermediate_size={desc.moe_ffn} is not divisible by trainer.expert_tensor_parallel={etp}")
    if desc.num_layers % tcfg.pipeline_parallel:
        raise ValueError(f"num_hidden_layers={desc.num_layers} is not divisible by trainer.pipeline_parallel={tcfg.pipeline_parallel}")
    for what, n in (("num_attention_heads", desc.num_heads), ("num_key_value_heads", desc.num_kv_heads)):
        if n % tcfg.tensor_parallel:
            raise ValueError(f"{what}={n} is not divisible by trainer.tensor_parallel={tcfg.tensor_parallel}")
    te = spec == "te"
    if tcfg.fp8 and not te:
        raise ValueError("trainer.fp8 needs trainer.layer_spec te (Transformer Engine)")
    kw = {}
    if tcfg.recompute != "none":
        kw["recompute_granularity"] = tcfg.recompute
        if tcfg.recompute == "full":
            kw.update(recompute_method="uniform", recompute_num_layers=1)
    if tcfg.fp8:
        kw.update(fp8=tcfg.fp8, fp8_recipe=tcfg.fp8_recipe)
    return TransformerConfig(
        num_layers=desc.num_layers, hidden_size=desc.hidden, ffn_hidden_size=desc.ffn,
        num_attention_heads=desc.num_heads, num_query_groups=desc.num_kv_heads, kv_channels=desc.head_dim,
        normalization="RMSNorm", layernorm_epsilon=desc.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=desc.qkv_bias, qk_layernorm=desc.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        # fused kernels on GPU (jit SwiGLU / bias-dropout-add; TE: fused RoPE incl. thd + CP,
        # wgrad accumulation straight into the fp32 main grads, which megatron's own output layer
        # can only do with NVIDIA apex's extension); none of them exists on CPU
        bias_activation_fusion=not on_cpu, bias_dropout_fusion=not on_cpu, masked_softmax_fusion=False,
        apply_rope_fusion=te and not on_cpu, persist_layer_norm=False,
        gradient_accumulation_fusion=te and not on_cpu and _wgrad_fusion_available(),
        tensor_model_parallel_size=tcfg.tensor_parallel, pipeline_model_parallel_size=tcfg.pipeline_parallel,
        context_parallel_size=tcfg.context_parallel, sequence_parallel=tcfg.sequence_parallel,
        expert_model_parallel_size=tcfg.expert_parallel,
        expert_tensor_parallel_size=etp if desc.is_moe else None,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu, perform_initialization=True,  # (also sets the TP attributes)
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True, deallocate_pipeline_outputs=True,
        **moe_kwargs(desc, on_cpu, desc.is_moe and grouped_experts(getattr(tcfg, "moe_experts", "auto"), spec)), **kw,
    )


def _rope_kwargs(desc: ModelDesc) -> dict:
    rs = desc.rope_scaling
    if rs is None:
        return {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "llama3":
        want = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        got = {k: float(rs.get(k, v)) for k, v in want.items()}
        if got != {k: float(v) for k, v in want.items()}:
            raise NotImplementedError(f"llama3 rope scaling with {got}; megatron-core supports only {want}")
        return dict(rope_scaling=True, rope_scaling_factor=float(rs["factor"]))
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported by the megatron backend")


def config_without_hooks(config):
    """A shallow copy of a TransformerConfig without the trainer's hooks (DDP ``no_sync``, grad
    finalisation / scaling: bound methods holding process groups). For models that never train
    (the reference): megatron's SequentialMLP deep-copies its config when the expert FFN size
    differs from the dense one, and process groups cannot be copied."""
    out = copy.copy(config)
    for k in ("no_sync_func", "finalize_model_grads_func", "grad_scale_func", "param_sync_func", "grad_sync_func"):
        if hasattr(out, k):
            setattr(out, k, None)
    return out


@dataclass
class BuiltModel:
    model: torch.nn.Module  # GPTModel (this stage), on its device
    desc: ModelDesc
    family: families.Family
    dims: Dims
    spec: str
    layer_offset: int
    #: the bucket iterator's row owners (computed once: shapes and placement never change)
    export_plan: Optional[tuple] = None
    #: MoE experts as TEGroupedMLP (``linear_fc1.weight{k}``) rather than SequentialMLP
    grouped_experts: bool = False


def build_model(desc: ModelDesc, family, config, spec: str, device: torch.device) -> BuiltModel:
    """This rank's pipeline stage of the GPTModel (megatron's random init; :func:`load_weights`
    overwrites every parameter)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp = ps.get_tensor_model_parallel_world_size()
    padded = desc.padded_vocab(VOCAB_DIVISIBLE_BY, tp)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(spec, desc, config), vocab_size=padded,
        max_sequence_length=desc.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=desc.tied,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=desc.rope_theta,
        **_rope_kwargs(desc),
    )
    if spec == "torch":
        use_document_rotary(model)  # packed micro-batches get their RoPE table once, not once a layer
    model.to(device)
    mark_expert_params(model)
    return BuiltModel(model, desc, family, desc.dims(padded), spec, get_transformer_layer_offset(config),
                      grouped_experts=bool(desc.is_moe and config.moe_grouped_gemm))


def mark_expert_params(model: torch.nn.Module) -> int:
    """Mark every expert weight (``.mlp.experts.``) ``allreduce = False``, at every EP including 1;
    returns how many. megatron's DDP and optimizer put such parameters in their expert buffers, whose
    gradients are reduced over the expert-data-parallel group (world / (expert-TP x EP x PP) ranks
    holding the same expert shard) instead of the dense DP x CP group. megatron's layers set the flag
    only when expert_parallel > 1; at EP 1 with expert-TP != TP the two groups differ (e.g. TP 2,
    expert-TP 1: both TP ranks hold whole experts and each saw only its sequence-parallel half of the
    tokens), and a dense all-reduce would leave each rank with half the gradient. Where the groups
    coincide the flag changes only which buffer holds the gradient."""
    n = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False
            n += 1
    return n


def local_name(bm: BuiltModel, pm: ParamMap, ep: int, ep_rank: int):
    """This rank's module name of table row ``pm`` (layer renumbered within the stage, expert
    renumbered within the EP rank, layer-spec renames), or None when another stage / EP rank
    holds it."""
    name = pm.megatron
    if pm.layer is not None:
        j = pm.layer - bm.layer_offset
        if not 0 <= j < len(bm.model.decoder.layers):
            return None
        name = name.replace(f"decoder.layers.{pm.layer}.", f"decoder.layers.{j}.", 1)
    if pm.expert is not None:
        n_local = bm.desc.num_experts // ep
        k = pm.expert - ep_rank * n_local
        if not 0 <= k < n_local:
            return None
        name = name.replace(f"local_experts.{pm.expert}.", f"local_experts.{k}.", 1)
        if bm.grouped_experts:
            name = families.grouped_expert_name(name)
    moe_layer = pm.layer is not None and bm.desc.is_moe_layer(pm.layer)
    return families.spec_name(name, bm.spec, moe_layer)


def local_param_maps(bm: BuiltModel) -> dict[str, ParamMap]:
    """This rank's Megatron parameter name -> the table row it comes from (rows whose parameter
    lives on another pipeline stage or expert-parallel rank are left out)."""
    from megatron.core import parallel_state as ps

    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    out = {}
    present = {n for n, _ in bm.model.named_parameters()}
    for pm in bm.family.param_maps(bm.desc):
        name = local_name(bm, pm, ep, ep_rank)
        if name is not None and name in present:
            out[name] = pm
    return out


def shard_group(pm: ParamMap) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group that shards row ``pm``: the expert-TP group for
    expert weights, the TP group otherwise."""
    from megatron.core import parallel_state as ps

    if pm.expert is not None:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


@torch.no_grad()
def load_weights(bm: BuiltModel, source: HFSource) -> None:
    """Copy HF tensors into every parameter of this rank (its stage, TP / expert-TP shard, experts)."""
    maps = local_param_maps(bm)
    params = dict(bm.model.named_parameters())
    missing = [n for n in params if n not in maps]
    if missing:
        raise KeyError(f"Megatron parameters without an HF source (family {bm.family.name}, spec {bm.spec}): {missing}")
    for name, p in params.items():
        tp, rank = shard_group(maps[name])
        shard = to_megatron_shard(maps[name], source, bm.dims, tp, rank)
        if tuple(shard.shape) != tuple(p.shape):
            raise ValueError(
                f"{name}: converted HF shard {tuple(shard.shape)} (from {list(maps[name].hf)}) does not "
                f"match the Megatron parameter {tuple(p.shape)}"
            )
        p.copy_(shard.to(dtype=p.dtype))


def hf_source(model_cfg, device: torch.device = torch.device("cpu")) -> tuple[object, HFSource]:
    """(HF config, weight source) for ``cfg.model``: ``model.path`` (safetensors, read lazily) or,
    when empty, the seeded random init of ``model.config`` that the torch backend and the embedded
    engine also use, made on ``device`` (the trainer's: the same values as theirs there, and seconds
    instead of minutes for a 2B model on a GPU)."""
    cfg = hf_config(model_cfg)
    if model_cfg.path:
        return cfg, HFSource(path=model_cfg.path)
    hf = load_hf_model(model_cfg, device)
    return cfg, HFSource(state_dict=families.split_fused_experts({k: v.detach() for k, v in hf.state_dict().items()}))
