#!/usr/bin/env python
"""The recipe's hyper-parameters mapped to verl 0.9.1's Hydra overrides, TRL 1.16.0's GRPOConfig and slime's
train.py flags (issue 39; slime's checked by its own parser: tools/peers/slime_check.py).

    python tools/peers/mapping.py verl --config configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml --data_dir D --steps 20 \
        --out_dir O [--variant mapped|best|defaults] [--model.path M ...]   # one override a line
    python tools/peers/mapping.py trl --config ... --steps 20 --out_dir O         # GRPOConfig's keyword arguments (JSON)
    python tools/peers/mapping.py slime --config ... --steps 20 --data_dir D --out_dir O [--hf_config C]  # slime's flags
    python tools/peers/mapping.py table                                           # the README's table (markdown)
    python tools/peers/mapping.py slime_table                                     # tools/peers/NEXT.md's slime table

:data:`TABLE` holds, for every key of configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml, verl's key, TRL's key and
what still differs; the functions below read the values from the megaforge config (so an override of the
recipe moves all three systems together). A recipe key missing from the table fails tests/tools/test_peers_mapping.py.

Batch geometry. megaforge step = ``rollout.batch_size`` (64) prompts x ``grpo.n_samples`` (8) = 512
samples, then ``trainer.mini_batches`` (4) optimizer updates of 128 samples in micro-batches of at most
``trainer.micro_batch_size`` (64) samples and ``trainer.micro_batch_tokens`` (16,384) packed positions.
The peers' micro-batches count samples, each padded (verl without remove-padding: to 320 + 512 = 832;
TRL: to the micro-batch's longest row, at most 832): :func:`peer_micro_batch` takes the largest divisor
of an update's 128 samples whose padded size stays within megaforge's token budget: 16 x 832 = 13,312.
* verl: ``data.train_batch_size`` = 64 prompts, ``rollout.n`` = 8, ``actor.ppo_mini_batch_size`` counts
  prompts: 64 / 4 = 16 (x n = 128 samples an update), ``ppo_micro_batch_size_per_gpu`` counts samples: 16;
  the ``best`` variant cuts by tokens like megaforge (``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu`` 16,384).
* TRL: ``per_device_train_batch_size`` = 16 samples (a micro-batch), ``gradient_accumulation_steps`` =
  128 / 16 = 8, ``steps_per_generation`` = 512 / 16 = 32 (one generation of 64 x 8 serves 32
  micro-batches = 4 optimizer steps): TRL's ``max_steps`` = 4 x megaforge's steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

VARIANTS = ("mapped", "best", "defaults")

# (recipe key, verl key(s), TRL key(s), what still differs and what it costs). "-": no counterpart.
TABLE = [
    ("output_dir, run_name", "trainer.default_local_dir, trainer.experiment_name", "output_dir, run_name", "where files go"),
    ("max_steps", "trainer.total_training_steps (+ total_epochs=1, a file of exactly steps x 64 rows)",
     "max_steps = 4 x steps (4 optimizer steps a megaforge step)", "the comparison runs 20-50 steps, not the recipe's 200"),
    ("seed", "data.shuffle=False (the order is in the file); rollout.seed / fsdp seed stay 42",
     "seed, shuffle_dataset=False", "sampling seeds differ: samples differ, distributions do not"),
    ("model.path", "actor_rollout_ref.model.path", "model (from_pretrained)", "same HF folder (the GGUF-converted Qwen2.5-Coder-0.5B-Instruct)"),
    ("model.dtype: bfloat16", "fsdp_config.model_dtype=fp32 + dtype=bfloat16 (mixed precision, verl's default); rollout.dtype=bfloat16",
     "bf16=True over fp32 weights (model_init_kwargs dtype float32)",
     "megaforge: bf16 weights + fp32 main params and Adam (Megatron distributed optimizer); verl and TRL keep fp32 "
     "weights and autocast: same optimizer precision, more weight memory"),
    ("data.path", "data.train_files (tools/peers/peer_data.py: train.parquet)", "train.jsonl of peer_data.py",
     "same rows in megaforge's order (its PromptSource, seed 0)"),
    ("data.input_key / label_key", "prompt / reward_model.ground_truth", "prompt / answer column", "-"),
    ("data.system_prompt", "system message in each row's prompt", "system message in each row's prompt",
     "peer_data.py checks the chat template renders the exact prompt text megaforge sends"),
    ("data.max_prompt_len: 320", "data.max_prompt_length=320 (truncation=error)", "- (no max_prompt_length in TRL 1.16)",
     "verl pads every prompt to 320 (left) when remove-padding is off"),
    ("grpo.n_samples: 8", "actor_rollout_ref.rollout.n=8", "num_generations=8", "-"),
    ("grpo.clip_low: 0.2", "actor.clip_ratio_low=0.2", "epsilon=0.2", "-"),
    ("grpo.clip_high: 0.28", "actor.clip_ratio_high=0.28", "epsilon_high=0.28",
     "verl also applies dual-clip (clip_ratio_c=3.0) to negative advantages; megaforge and TRL do not"),
    ("grpo.beta: 0.0", "actor.use_kl_loss=False, algorithm.use_kl_in_reward=False", "beta=0.0", "no reference model in any"),
    ("grpo.temperature: 0.7", "rollout.temperature=0.7 (top_p 1, top_k -1)", "temperature=0.7, top_p=1.0, top_k=0", "-"),
    ("algo.advantage: grpo", "algorithm.adv_estimator=grpo, norm_adv_by_std_in_grpo=True", "scale_rewards='group'",
     "std epsilon: megaforge 1e-6, verl 1e-6, TRL 1e-4 (only matters for near-equal rewards, i.e. all-0/all-1 groups, which are 0 in all)"),
    ("algo.loss: ppo_clip", "actor.policy_loss.loss_mode=vanilla", "loss_type='dapo' (clipped surrogate)", "-"),
    ("algo.loss_agg: token_mean", "actor.loss_agg_mode=token-mean", "loss_type='dapo' (tokens of the global accumulated batch)",
     "all three: mean over the tokens of one update's 128 samples"),
    ("rewards.functions: math", "reward.custom_reward_function.path=tools/peers/peer_reward.py, name=compute_score",
     "reward_funcs=[peer_reward.trl_math_reward]", "the same megaforge MathReward; megaforge bounds each call's time, the peers do not"),
    ("rewards.workers: 8", "reward.num_workers=8 (Ray reward-loop workers)", "- (in the training process)", "-"),
    ("rollout.engine: sglang", "actor_rollout_ref.rollout.name=sglang (mode async, in a Ray actor)",
     "HF generate (use_vllm=False); best: use_vllm=True, vllm_mode=colocate",
     "TRL has no SGLang path: HF generate with a dynamic cache is ~10k tok/s on this shape vs SGLang's ~98k (gpu-machine notes)"),
    ("rollout.batch_size: 64", "data.train_batch_size=64", "generation_batch_size=512 (= 16 x 32)", "-"),
    ("rollout.max_new_tokens: 512", "data.max_response_length=512", "max_completion_length=512",
     "verl pads every response to 512 when remove-padding is off: 320 + 512 = 832 tokens a row"),
    ("rollout.mem_fraction: 0.5", "rollout.gpu_memory_utilization=0.5", "vllm_gpu_memory_utilization=0.5 (vLLM only)", "-"),
    ("rollout.extra_args (triton attention, pytorch sampling, no prefill graphs, decode graphs 1..512)",
     "+rollout.engine_kwargs.sglang.{attention_backend=triton, sampling_backend=pytorch, cuda_graph_backend_prefill=disabled, "
     "cuda_graph_bs_decode=[...]}, rollout.max_num_seqs=512", "- (HF generate)", "verl would pick flashinfer attention otherwise"),
    ("rollout.max_restarts / snapshot_dir", "-", "-", "megaforge's engine fault tolerance; no cost when nothing fails"),
    ("rollout.device / fast / dtype / engine_batch_size", "-", "-", "megaforge's embedded engine only (not used by the recipe's main path)"),
    ("trainer.backend: megatron, layer_spec: torch", "FSDP (actor.strategy=fsdp), HF Qwen2 modules, attn sdpa",
     "accelerate, HF Qwen2 modules, attn sdpa", "megaforge's torch spec = Megatron layers with torch attention; verl best: flash-attn 2 + remove-padding"),
    ("trainer.device: cuda", "trainer.device=cuda, n_gpus_per_node=1", "(accelerate: the one GPU)", "-"),
    ("trainer.lr: 3.0e-6", "actor.optim.lr=3e-6 (lr_scheduler_type=constant, warmup 0)", "learning_rate=3e-6, lr_scheduler_type='constant', warmup_steps=0", "-"),
    ("trainer.weight_decay (0.0), betas, eps (defaults)", "actor.optim.weight_decay=0.0 (verl default 0.01), betas [0.9, 0.999]",
     "weight_decay=0.0, adam_beta1/2 0.9/0.999, adam_epsilon 1e-8", "-"),
    ("trainer.micro_batch_size: 64, micro_batch_tokens: 16384",
     "actor.ppo_micro_batch_size_per_gpu=16, rollout.log_prob_micro_batch_size_per_gpu=16 (16 x 832 padded <= 16,384); "
     "best: use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16384, log_prob_max_token_len_per_gpu=16384",
     "per_device_train_batch_size=16 (16 x at most 832 <= 16,384)",
     "megaforge packs length-ordered rows up to 16,384 positions (~36 GSM8K rows, ~4 micro-batches an update); verl mapped "
     "and TRL run 8 micro-batches of 16 padded rows an update (verl to 832, TRL to the longest in the micro-batch)"),
    ("trainer.mini_batches: 4", "actor.ppo_mini_batch_size=16 prompts (64 / 4), ppo_epochs=1",
     "gradient_accumulation_steps=8, steps_per_generation=32, num_iterations=1", "-"),
    ("trainer.grad_clip: 1.0", "actor.optim.clip_grad=1.0 (and actor.grad_clip=1.0)", "max_grad_norm=1.0", "-"),
    ("trainer.gradient_checkpointing / recompute (off)", "actor_rollout_ref.model.enable_gradient_checkpointing=False (verl default True)",
     "gradient_checkpointing=False (TRL default True)", "both peers' defaults recompute activations (~30% more train time); the defaults variant measures that"),
    ("pi_old (recomputed by the trainer)", "timing_s/old_log_prob (always recomputed)",
     "old_per_token_logps: recomputed because gradient_accumulation_steps (8) % steps_per_generation (32) != 0", "-"),
    ("trainer.distributed_optimizer: true", "- (FSDP shards; one GPU: nothing to shard)", "-", "-"),
    ("memory.offload: auto", "fsdp param_offload=False, optimizer_offload=False (verl's default: state stays on the GPU)",
     "- (HF generate: one copy of the model)", "none on an H100 / H200 (the planner: the state fits beside SGLang), as in verl; hold 1 ran megaforge with pinned (~6 GB of trainer state to host memory and back each step, ~0.44 s)"),
    ("sync.transport: ipc, bucket_mb: 512", "checkpoint_engine.backend=naive, update_weights_bucket_megabytes=2048",
     "- (HF generate) / vLLM colocate: load_weights in process", "-"),
    ("eval.sets (GSM8K test), interval 10, before_train", "data.val_files=test.parquet, trainer.test_freq=10, val_before_train (cross-check only)",
     "- (checkpoints every 10 steps, evaluated after)", "accuracy is graded by tools/evaluate.py on each system's HF export at steps 0/10/20"),
    ("eval.n_samples: 2", "rollout.val_kwargs.n=1, do_sample=False (greedy)", "-", "only greedy pass@1 is compared"),
    ("metrics.tensorboard, log_samples", "trainer.logger=[console,file] (VERL_FILE_LOGGER_PATH)", "report_to=none + tools/peers/trl_grpo.py's per-step lines", "-"),
    ("checkpoint.interval: 10, keep_last_n: 1", "trainer.save_freq=10, actor.checkpoint.save_contents=[hf_model], max_actor_ckpt_to_keep=3",
     "save_steps=40 (10 megaforge steps), save_only_model=True", "verl times its checkpoint inside timing_s/step: the parser subtracts timing_s/save_checkpoint"),
]

RECIPE_KEYS = [  # every leaf key of configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml, and the TABLE row that maps it
    "output_dir", "run_name", "max_steps", "seed", "model.path", "model.dtype", "data.path", "data.input_key",
    "data.label_key", "data.system_prompt", "data.max_prompt_len", "grpo.n_samples", "grpo.clip_low", "grpo.clip_high",
    "grpo.beta", "grpo.temperature", "algo.advantage", "algo.loss", "algo.loss_agg", "rewards.functions",
    "rewards.workers", "rollout.engine", "rollout.batch_size", "rollout.max_new_tokens", "rollout.mem_fraction",
    "rollout.extra_args", "rollout.max_restarts", "rollout.snapshot_dir", "rollout.device", "rollout.fast",
    "rollout.dtype", "rollout.engine_batch_size", "trainer.backend", "trainer.layer_spec", "trainer.device",
    "trainer.lr", "trainer.micro_batch_size", "trainer.micro_batch_tokens", "trainer.mini_batches", "trainer.grad_clip",
    "trainer.distributed_optimizer", "memory.offload", "sync.transport", "sync.bucket_mb", "eval.sets",
    "eval.interval", "eval.before_train", "eval.n_samples", "metrics.tensorboard", "metrics.log_samples",
    "checkpoint.interval", "checkpoint.keep_last_n",
]


def row_for(key: str):
    """The TABLE row that maps recipe key ``key`` (its section and name both named in the row's first cell)."""
    section, _, name = key.rpartition(".")
    for row in TABLE:
        cell = row[0]
        if (not section and name in [c.strip().split(":")[0] for c in cell.split(",")]) or \
                (section and cell.startswith(section + ".") and name in cell):
            return row
    return None


class MappingError(ValueError):
    """The recipe's geometry cannot be expressed in a peer's keys."""


def peer_micro_batch(cfg, per_update: int) -> int:
    """Samples in a peer's micro-batch: ``trainer.micro_batch_size`` without a token budget; with one
    (``trainer.micro_batch_tokens``), the largest divisor of ``per_update`` that is at most
    micro_batch_size and whose rows, padded to max_prompt_len + max_new_tokens, fit the budget."""
    mb, budget = cfg.trainer.micro_batch_size, cfg.trainer.micro_batch_tokens
    if not budget:
        if per_update % mb:
            raise MappingError(f"an update's {per_update} samples are not a multiple of trainer.micro_batch_size {mb}")
        return mb
    row = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    fits = [d for d in range(1, min(mb, per_update) + 1) if per_update % d == 0 and d * row <= budget]
    if not fits:
        raise MappingError(f"trainer.micro_batch_tokens {budget} holds no padded row of {row} positions "
                           f"(data.max_prompt_len + rollout.max_new_tokens): the peers cannot cut micro-batches by it")
    return fits[-1]


def geometry(cfg) -> dict:
    """Batch sizes of the three systems from megaforge's config (see the module docstring)."""
    n, prompts, minis = cfg.grpo.n_samples, cfg.rollout.batch_size, cfg.trainer.mini_batches
    samples = prompts * n
    if prompts % minis:
        raise MappingError(f"rollout.batch_size {prompts} is not a multiple of trainer.mini_batches {minis} "
                           f"(verl's ppo_mini_batch_size counts prompts)")
    per_update = samples // minis
    mb = peer_micro_batch(cfg, per_update)
    return {"samples": samples, "per_update": per_update, "verl_mini_prompts": prompts // minis,
            "trl_grad_accum": per_update // mb, "trl_steps_per_generation": samples // mb, "updates": minis,
            "micro_batch": mb,  # a token budget a micro-batch for the peers that pack by tokens (verl best, slime):
            "micro_batch_tokens": cfg.trainer.micro_batch_tokens or mb * (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)}


def _extra_args(cfg) -> dict:
    """rollout.extra_args (``--flag [value ...]``, read by server_flags) as SGLang ServerArgs fields (verl's
    engine_kwargs.sglang): a flag alone is True, one value a scalar, several a list (numbers as ints)."""
    from megaforge.config.rollout import server_flags
    try:
        flags = server_flags(cfg.rollout.extra_args)
    except ValueError as e:
        raise MappingError(str(e)) from None
    vals = {k[2:].replace("-", "_"): [int(a) if a.isdigit() else a for a in v] for k, v in flags.items()}
    return {k: True if not v else v[0] if len(v) == 1 else v for k, v in vals.items()}


def _hydra(v) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, list):
        return "[" + ",".join(_hydra(x) for x in v) + "]"
    return str(v)


def verl_overrides(cfg, data_dir: str, steps: int, out_dir: str, variant: str = "mapped", model_path: str = "",
                   test_freq: int = 10, val_before_train: bool = False, save_freq: int = 10) -> list[str]:
    """verl 0.9.1 Hydra overrides for ``python -m verl.trainer.main_ppo`` (see TABLE).

    ``mapped``: the recipe as close as verl goes without flash-attn (sdpa, no remove-padding, no
    gradient checkpointing). ``best``: verl's throughput settings (flash-attn 2 + remove-padding +
    dynamic batch size; needs flash_attn on the machine). ``defaults``: the mapped run with verl's own
    defaults where they differ (gradient checkpointing, weight decay 0.01)."""
    if variant not in VARIANTS:
        raise MappingError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}")
    g = geometry(cfg)
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    mb = g["micro_batch"]
    o = [
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=True", "algorithm.use_kl_in_reward=False",
        f"data.train_files={data_dir}/train.parquet", f"data.val_files={data_dir}/test.parquet",
        f"data.train_batch_size={cfg.rollout.batch_size}", f"data.max_prompt_length={cfg.data.max_prompt_len}",
        f"data.max_response_length={cfg.rollout.max_new_tokens}", "data.shuffle=False", "data.filter_overlong_prompts=False",
        "data.truncation=error",
        f"actor_rollout_ref.model.path={model_path or cfg.model.path}",
        f"{a}.optim.lr={cfg.trainer.lr}", "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        f"{a}.optim.lr_scheduler_type={cfg.trainer.lr_schedule}",
        f"{a}.optim.weight_decay={0.01 if variant == 'defaults' else cfg.trainer.weight_decay}",
        f"{a}.optim.betas={_hydra(list(cfg.trainer.betas))}",
        f"{a}.optim.clip_grad={cfg.trainer.grad_clip}", f"{a}.grad_clip={cfg.trainer.grad_clip}",
        f"{a}.ppo_mini_batch_size={g['verl_mini_prompts']}", f"{a}.ppo_epochs={cfg.trainer.epochs}",
        f"{a}.clip_ratio_low={cfg.grpo.clip_low}", f"{a}.clip_ratio_high={cfg.grpo.clip_high}",
        f"{a}.loss_agg_mode={cfg.algo.loss_agg.replace('_', '-') if cfg.algo.loss_agg else 'token-mean'}",
        f"{a}.use_kl_loss={cfg.grpo.beta > 0}", f"{a}.entropy_coeff=0",
        f"{a}.checkpoint.save_contents=[hf_model]",
        f"{r}.name=sglang", f"{r}.n={cfg.grpo.n_samples}", f"{r}.temperature={cfg.grpo.temperature}",
        f"{r}.top_p={cfg.rollout.top_p}", f"{r}.top_k={cfg.rollout.top_k}",
        f"{r}.tensor_model_parallel_size=1", f"{r}.gpu_memory_utilization={cfg.rollout.mem_fraction}",
        f"{r}.max_num_seqs={g['samples']}",
        f"{r}.val_kwargs.do_sample=False", f"{r}.val_kwargs.temperature=0", f"{r}.val_kwargs.n=1",
        f"reward.custom_reward_function.path={os.path.join(ROOT, 'tools', 'peers', 'peer_reward.py')}",
        "reward.custom_reward_function.name=compute_score", f"reward.num_workers={cfg.rewards.workers or 8}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cuda", "trainer.total_epochs=1",
        f"trainer.total_training_steps={steps}", f"trainer.val_before_train={val_before_train}",
        f"trainer.test_freq={test_freq}", f"trainer.save_freq={save_freq}", "trainer.max_actor_ckpt_to_keep=3",
        "trainer.resume_mode=disable", "trainer.logger=[console,file]", "trainer.project_name=megaforge_peers",
        f"trainer.experiment_name=verl_{variant}", f"trainer.default_local_dir={out_dir}/ckpt",
    ]
    for k, v in _extra_args(cfg).items():
        o.append(f"+{r}.engine_kwargs.sglang.{k}={_hydra(v)}")
    if variant == "best":
        tokens = g["micro_batch_tokens"]
        o += ["actor_rollout_ref.model.use_remove_padding=True", f"{a}.use_dynamic_bsz=True",
              "actor_rollout_ref.model.enable_gradient_checkpointing=False",
              f"{a}.ppo_max_token_len_per_gpu={tokens}", f"{r}.log_prob_max_token_len_per_gpu={tokens}"]
    else:
        o += ["actor_rollout_ref.model.use_remove_padding=False", "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
              f"{a}.use_dynamic_bsz=False", f"{a}.ppo_micro_batch_size_per_gpu={mb}",
              f"{r}.log_prob_micro_batch_size_per_gpu={mb}",
              f"actor_rollout_ref.model.enable_gradient_checkpointing={variant == 'defaults'}"]
    return o


TRL_DEFAULT_MICRO_BATCH = 8  # transformers' TrainingArguments.per_device_train_batch_size


def trl_kwargs(cfg, steps: int, out_dir: str, use_vllm: bool = False, save_every: int = 10, bf16: bool = True,
               variant: str = "mapped") -> dict:
    """TRL 1.16.0 GRPOConfig keyword arguments (see TABLE). ``steps`` counts megaforge steps. ``variant``
    ``defaults``: TRL's own settings where they are not the recipe's algorithm, i.e. gradient checkpointing on (GRPOConfig's
    default) and micro-batches of 8 rows (TrainingArguments' default; gradient accumulation and steps per generation
    scaled so an update is still 128 samples and a generation 512); ``best`` is ``use_vllm``."""
    if variant not in ("mapped", "defaults"):
        raise MappingError(f"TRL variant {variant!r} is not one of mapped, defaults (best: --use_vllm)")
    g = dict(geometry(cfg))
    if variant == "defaults":
        mb = TRL_DEFAULT_MICRO_BATCH
        if g["per_update"] % mb:
            raise MappingError(f"an update of {g['per_update']} samples is not a multiple of TRL's default micro-batch {mb}")
        g.update(micro_batch=mb, trl_grad_accum=g["per_update"] // mb, trl_steps_per_generation=g["samples"] // mb)
    kw = dict(
        output_dir=out_dir, run_name=cfg.run_name, seed=cfg.seed, max_steps=steps * g["updates"],
        per_device_train_batch_size=g["micro_batch"], gradient_accumulation_steps=g["trl_grad_accum"],
        steps_per_generation=g["trl_steps_per_generation"], num_generations=cfg.grpo.n_samples, num_iterations=cfg.trainer.epochs,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.grpo.temperature, top_p=cfg.rollout.top_p,
        top_k=max(cfg.rollout.top_k, 0), learning_rate=cfg.trainer.lr, lr_scheduler_type=cfg.trainer.lr_schedule,
        warmup_steps=cfg.trainer.warmup_steps, weight_decay=cfg.trainer.weight_decay, adam_beta1=cfg.trainer.betas[0],
        adam_beta2=cfg.trainer.betas[1], adam_epsilon=cfg.trainer.eps, max_grad_norm=cfg.trainer.grad_clip,
        epsilon=cfg.grpo.clip_low, epsilon_high=cfg.grpo.clip_high, beta=cfg.grpo.beta, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False, bf16=bf16, gradient_checkpointing=variant == "defaults",
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="steps" if save_every else "no",
        save_steps=max(save_every, 1) * g["updates"], save_only_model=True, dataloader_num_workers=0,
        disable_dropout=True, log_completions=False,
    )
    if use_vllm:
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=cfg.rollout.mem_fraction,
                  vllm_importance_sampling_correction=False, vllm_enable_sleep_mode=True)
    return kw


# slime (THUDM/slime at SLIME_COMMIT; its Megatron-LM and SGLang, patched: tools/peers/NEXT.md, B): one row per TABLE
# row, same recipe keys in the same order (a test keeps them aligned). Not run on a GPU yet.
SLIME_COMMIT = "624b824a8"
SLIME_TABLE = [
    ("output_dir, run_name", "--save, --save-hf (no run name: console logs)", "where files go"),
    ("max_steps", "--num-rollout (one rollout = one megaforge step)", "-"),
    ("seed", "--seed, --rollout-seed; no --rollout-shuffle (the file's order)", "sampling seeds differ"),
    ("model.path", "--hf-checkpoint, --ref-load (slime loads the HF folder itself) + the Qwen2 shape flags from its "
     "config.json (--num-layers ... --untie-embeddings-and-output-weights: the GGUF-converted model is untied)",
     "slime's own checker refuses a tied/untied mismatch (hf_validate_args)"),
    ("model.dtype: bfloat16", "--bf16 (Megatron: bf16 weights, fp32 main params in the optimizer), "
     "--accumulate-allreduce-grads-in-fp32, --attention-softmax-in-fp32", "-"),
    ("data.path", "--prompt-data <data_dir>/train.jsonl (peer_data.py's TRL file)", "same rows in megaforge's order"),
    ("data.input_key / label_key", "--input-key prompt --label-key answer --apply-chat-template", "-"),
    ("data.system_prompt", "system message in each row's prompt", "slime renders the chat template itself (add_generation_prompt)"),
    ("data.max_prompt_len: 320", "--rollout-max-prompt-len 320", "slime drops longer prompts (none are)"),
    ("grpo.n_samples: 8", "--n-samples-per-prompt 8", "-"),
    ("grpo.clip_low: 0.2", "--eps-clip 0.2", "-"),
    ("grpo.clip_high: 0.28", "--eps-clip-high 0.28", "-"),
    ("grpo.beta: 0.0", "--kl-coef 0.0, no --use-kl-loss", "no reference model"),
    ("grpo.temperature: 0.7", "--rollout-temperature 0.7 --rollout-top-p 1.0 --rollout-top-k -1", "-"),
    ("algo.advantage: grpo", "--advantage-estimator grpo (std normalisation on: slime's default)", "-"),
    ("algo.loss: ppo_clip", "slime's policy loss (clipped surrogate), --entropy-coef 0.0", "-"),
    ("algo.loss_agg: token_mean", "--calculate-per-token-loss", "-"),
    ("rewards.functions: math", "--custom-rm-path peer_reward.slime_math_reward (tools/peers on PYTHONPATH)",
     "the same megaforge MathReward, awaited per sample in slime's rollout manager"),
    ("rewards.workers: 8", "- (asyncio in the rollout manager)", "-"),
    ("rollout.engine: sglang", "SGLang (its server in a Ray actor, behind sglang_router)", "slime's SGLang is 0.5.15.post1 "
     "with slime's five patches (they do not apply to 0.5.16); router from PyPI (0.3.2), not slime's fork"),
    ("rollout.batch_size: 64", "--rollout-batch-size 64", "-"),
    ("rollout.max_new_tokens: 512", "--rollout-max-response-len 512", "-"),
    ("rollout.mem_fraction: 0.5", "--sglang-mem-fraction-static 0.5", "-"),
    ("rollout.extra_args (triton attention, pytorch sampling, no prefill graphs, decode graphs 1..512)",
     "--sglang-attention-backend triton --sglang-sampling-backend pytorch --sglang-cuda-graph-backend-prefill disabled "
     "--sglang-cuda-graph-bs-decode 1 ... 512", "-"),
    ("rollout.max_restarts / snapshot_dir", "- (slime's --use-fault-tolerance not set)", "-"),
    ("rollout.device / fast / dtype / engine_batch_size", "-", "megaforge's embedded engine only"),
    ("trainer.backend: megatron, layer_spec: torch", "Megatron-LM (patched) with the Transformer Engine spec, "
     "--attention-backend fused (TE's cuDNN attention), --no-gradient-accumulation-fusion (no apex)",
     "slime's HF <-> Megatron converters name the TE spec's fused-norm weights: the local spec does not load; "
     "--attention-backend flash would need flash-attn"),
    ("trainer.device: cuda", "--actor-num-nodes 1 --actor-num-gpus-per-node 1 --num-gpus-per-node 1 --colocate "
     "--rollout-num-gpus-per-engine 1", "-"),
    ("trainer.lr: 3.0e-6", "--lr 3e-6 --lr-decay-style constant --lr-warmup-iters 0", "-"),
    ("trainer.weight_decay (0.0), betas, eps (defaults)", "--optimizer adam --weight-decay 0.0 --adam-beta1 0.9 "
     "--adam-beta2 0.999 --adam-eps 1e-8", "slime's scripts use 0.1 and 0.98"),
    ("trainer.micro_batch_size: 64, micro_batch_tokens: 16384", "--use-dynamic-batch-size --max-tokens-per-gpu 16384",
     "both pack rows up to 16,384 tokens a micro-batch"),
    ("trainer.mini_batches: 4", "--global-batch-size 128 (64 x 8 / 4: 4 updates a rollout)", "-"),
    ("trainer.grad_clip: 1.0", "--clip-grad 1.0", "-"),
    ("trainer.gradient_checkpointing / recompute (off)", "- (Megatron recomputes nothing by default)", "-"),
    ("pi_old (recomputed by the trainer)", "recomputed by the Megatron actor (no --use-rollout-logprobs)", "-"),
    ("trainer.distributed_optimizer: true", "--use-distributed-optimizer", "one GPU: nothing to shard"),
    ("memory.offload: auto", "--colocate implies --offload-train and --offload-rollout",
     "slime always moves its trainer state to host memory and back (torch_memory_saver) on one GPU; megaforge's "
     "planner keeps it on an H100/H200"),
    ("sync.transport: ipc, bucket_mb: 512", "update_weights_from_tensor (CUDA IPC), --update-weight-buffer-size 536870912",
     "-"),
    ("eval.sets (GSM8K test), interval 10, before_train", "- (no --eval-interval: tools/evaluate.py grades the HF exports)",
     "-"),
    ("eval.n_samples: 2", "-", "only greedy pass@1 is compared"),
    ("metrics.tensorboard, log_samples", "- (no --use-wandb; wandb is still imported: slime/observability/logging_utils.py)",
     "slime's perf/* lines to parse (not written yet)"),
    ("checkpoint.interval: 10, keep_last_n: 1", "--save-interval 10 --no-save-optim, --save-hf .../rollout_{rollout_id}",
     "slime's rollout_id counts from 0: megaforge's step 10 is rollout_9; slime writes a Megatron checkpoint too"),
]


def slime_model_args(hf: dict) -> list[str]:
    """Megatron's shape flags for a Qwen2 HF config (slime's scripts/models/qwen2.5-0.5B.sh, from the config)."""
    if hf.get("model_type") != "qwen2":
        raise MappingError(f"slime's mapping knows the qwen2 shape only, not {hf.get('model_type')!r}")
    out = ["--swiglu", f"--num-layers {hf['num_hidden_layers']}", f"--hidden-size {hf['hidden_size']}",
           f"--ffn-hidden-size {hf['intermediate_size']}", f"--num-attention-heads {hf['num_attention_heads']}",
           "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias", "--normalization RMSNorm",
           f"--norm-epsilon {hf['rms_norm_eps']}", f"--rotary-base {int(hf.get('rope_theta', 10000))}",
           "--group-query-attention", f"--num-query-groups {hf['num_key_value_heads']}", f"--vocab-size {hf['vocab_size']}"]
    if not hf.get("tie_word_embeddings", False):
        out.append("--untie-embeddings-and-output-weights")
    return out


def slime_args(cfg, data_dir: str, steps: int, out_dir: str, model_path: str = "", hf_config: str = "") -> list[str]:
    """slime's ``train.py`` flags, one flag with its values an item (see SLIME_TABLE). ``hf_config``: the model's
    config.json when ``model.path`` is not on this machine (configs/models/qwen2.5-coder-0.5b/config.json: the
    recipe's GGUF-converted model)."""
    g = geometry(cfg)
    model = model_path or cfg.model.path
    with open(hf_config or os.path.join(model, "config.json")) as f:
        hf = json.load(f)
    if cfg.algo.advantage != "grpo" or cfg.algo.loss_agg != "token_mean" or cfg.trainer.lr_schedule != "constant":
        raise MappingError("slime's mapping covers grpo, token_mean and a constant lr only")
    o = ["--actor-num-nodes 1", "--actor-num-gpus-per-node 1", "--num-gpus-per-node 1", "--colocate",
         "--rollout-num-gpus-per-engine 1", f"--hf-checkpoint {model}", f"--ref-load {model}",
         *slime_model_args(hf),
         f"--prompt-data {data_dir}/train.jsonl", "--input-key prompt", "--label-key answer", "--apply-chat-template",
         f"--num-rollout {steps}", f"--rollout-batch-size {cfg.rollout.batch_size}",
         f"--n-samples-per-prompt {cfg.grpo.n_samples}", f"--global-batch-size {g['per_update']}",
         f"--rollout-max-prompt-len {cfg.data.max_prompt_len}", f"--rollout-max-response-len {cfg.rollout.max_new_tokens}",
         f"--rollout-temperature {cfg.grpo.temperature}", f"--rollout-top-p {cfg.rollout.top_p}",
         f"--rollout-top-k {cfg.rollout.top_k if cfg.rollout.top_k > 0 else -1}",
         f"--seed {cfg.seed}", f"--rollout-seed {cfg.seed}",
         "--custom-rm-path peer_reward.slime_math_reward",
         "--advantage-estimator grpo", f"--eps-clip {cfg.grpo.clip_low}", f"--eps-clip-high {cfg.grpo.clip_high}",
         "--entropy-coef 0.0", f"--kl-coef {cfg.grpo.beta}", "--calculate-per-token-loss"]
    if cfg.grpo.beta > 0:
        o += ["--use-kl-loss", f"--kl-loss-coef {cfg.grpo.beta}"]
    o += ["--optimizer adam", f"--lr {cfg.trainer.lr}", "--lr-decay-style constant",
          f"--lr-warmup-iters {cfg.trainer.warmup_steps}", f"--weight-decay {cfg.trainer.weight_decay}",
          f"--adam-beta1 {cfg.trainer.betas[0]}", f"--adam-beta2 {cfg.trainer.betas[1]}", f"--adam-eps {cfg.trainer.eps}",
          f"--clip-grad {cfg.trainer.grad_clip}",
          "--tensor-model-parallel-size 1", "--pipeline-model-parallel-size 1", "--context-parallel-size 1",
          "--expert-model-parallel-size 1", "--expert-tensor-parallel-size 1",
          "--use-dynamic-batch-size",
          f"--max-tokens-per-gpu {g['micro_batch_tokens']}",
          "--bf16" if cfg.model.dtype == "bfloat16" else "--fp16" if cfg.model.dtype == "float16" else "--no-bf16",
          "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-dropout 0.0",
          "--hidden-dropout 0.0", "--attention-backend fused", "--no-gradient-accumulation-fusion"]
    if cfg.trainer.distributed_optimizer:
        o.append("--use-distributed-optimizer")
    if cfg.trainer.gradient_checkpointing:
        o.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    o.append(f"--sglang-mem-fraction-static {cfg.rollout.mem_fraction}")
    for k, v in _extra_args(cfg).items():
        flag = "--sglang-" + k.replace("_", "-")
        o.append(flag if v is True else f"{flag} {' '.join(map(str, v)) if isinstance(v, list) else v}")
    o += [f"--update-weight-buffer-size {cfg.sync.bucket_mb * 2**20}",
          f"--save {out_dir}/ckpt", f"--save-interval {cfg.checkpoint.interval or steps}", "--no-save-optim",
          f"--save-hf {out_dir}/hf/rollout_{{rollout_id}}"]
    return o


def slime_table_markdown() -> str:
    lines = [f"| recipe key (configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml) | slime ({SLIME_COMMIT}) train.py | what still differs, and its cost |",
             "|---|---|---|"]
    for row in SLIME_TABLE:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    return "\n".join(lines)


def table_markdown() -> str:
    lines = ["| recipe key (configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml) | verl 0.9.1 | TRL 1.16.0 GRPOConfig | what still differs, and its cost |",
             "|---|---|---|---|"]
    for row in TABLE:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("peer", choices=["verl", "trl", "slime", "table", "slime_table"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--data_dir", default="/tmp/peers/data")
    p.add_argument("--out_dir", default="/tmp/peers/out")
    p.add_argument("--variant", default="mapped", choices=VARIANTS)
    p.add_argument("--test_freq", type=int, default=10)
    p.add_argument("--save_freq", type=int, default=10)
    p.add_argument("--val_before_train", action="store_true")
    p.add_argument("--use_vllm", action="store_true")
    p.add_argument("--hf_config", default="", help="slime: the model's config.json when model.path is not here")
    a, rest = p.parse_known_args(argv)
    if a.peer in ("table", "slime_table"):
        print(table_markdown() if a.peer == "table" else slime_table_markdown())
        return 0
    from megaforge.config import ConfigError, load_config
    try:
        cfg = load_config(rest)
        if a.peer == "verl":
            print("\n".join(verl_overrides(cfg, a.data_dir, a.steps, a.out_dir, a.variant, test_freq=a.test_freq,
                                           val_before_train=a.val_before_train, save_freq=a.save_freq)))
        elif a.peer == "slime":
            print("\n".join(slime_args(cfg, a.data_dir, a.steps, a.out_dir, hf_config=a.hf_config)))
        else:
            print(json.dumps(trl_kwargs(cfg, a.steps, a.out_dir, a.use_vllm, a.save_freq,
                                        variant="mapped" if a.variant == "best" else a.variant)))
    except ConfigError as e:
        print(f"megaforge: config error: {e}", file=sys.stderr)
        return 2
    except MappingError as e:
        print(f"megaforge: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
