"""Keys of torchforge, TRL (``GRPOConfig``) and verl configs, mapped to megaforge's: consulted before the
nearest-key guess (megaforge.configtree), so ``training.learning_rate`` says "use trainer.lr" instead of
the closest spelling (``trainer.min_lr``). Pure data and one lookup; no megaforge imports.

Lookup of an unknown dotted key: the key itself; with verl's ``actor_rollout_ref.`` prefix added
(``rollout.n``); its last part among the flat (TRL) keys (``trainer.learning_rate``). A section given a
mapping of unknown keys reports the hint of each child that has one.
"""
from __future__ import annotations

from typing import Any, Optional

TF, TRL, VERL = "torchforge", "TRL", "verl"
_ACCUM = ("no such key: gradients accumulate over every micro-batch (trainer.micro_batch_size sequences) of a "
          "mini-batch; optimizer steps per RL step: trainer.mini_batches")
_SEQ = "data.max_prompt_len (prompt tokens) and rollout.max_new_tokens (response tokens); SFT: sft.max_len"

#: {dotted key elsewhere: (framework, advice)}
ALIASES: dict[str, tuple[str, str]] = {
    # torchforge (its README's config/grpo_math.yaml and distributed.yaml)
    "dataset": (TF, "use data (data.path, data.split, data.streaming)"),
    "dataset.path": (TF, "use data.path"),
    "dataset.split": (TF, "use data.split"),
    "dataset.streaming": (TF, "use data.streaming"),
    "training": (TF, "its keys are trainer.* (RL) and sft.* (the warm start)"),
    "training.batch_size": (TF, "use rollout.batch_size (prompts per RL step, each sampled grpo.n_samples times); "
                                "trainer.micro_batch_size is sequences per forward/backward"),
    "training.learning_rate": (TF, "use trainer.lr (sft.lr for the SFT warm start)"),
    "training.seq_len": (TF, "use " + _SEQ),
    "training.dtype": (TF, "use model.dtype"),
    "training.gradient_accumulation_steps": (TF, _ACCUM),
    "training.sync_interval": (TF, "use sync.interval"),
    "training.entropy_coef": (TF, "use algo.entropy_coef"),
    "services": (TF, "no such section: megaforge places its processes itself: the trainer on torchrun's ranks "
                     "(trainer.tensor_parallel / pipeline_parallel / ...), the engines colocated or on "
                     "rollout.num_gpus GPUs (rollout.num_engines, rollout.tensor_parallel), the reference "
                     "model with the trainer (trainer.ref_device same | cpu)"),
    "services.generator.procs": (TF, "use rollout.tensor_parallel"),
    "services.generator.num_replicas": (TF, "use rollout.num_engines"),
    "services.generator.with_gpus": (TF, "use rollout.device"),
    "services.trainer.procs": (TF, "torchrun --nproc_per_node (the trainer's ranks)"),
    "services.ref_model.with_gpus": (TF, "use trainer.ref_device (cpu for with_gpus: false)"),
    "ref_model": (TF, "the reference model lives with the trainer: trainer.ref_device same | cpu; grpo.beta 0 "
                      "disables it"),
    "ref_model.with_gpus": (TF, "use trainer.ref_device (cpu for with_gpus: false, same: the trainer's GPU)"),
    "parallelism.tensor_parallel_degree": (TF, "use trainer.tensor_parallel"),
    "parallelism.pipeline_parallel_degree": (TF, "use trainer.pipeline_parallel"),
    "parallelism.data_parallel_shard_degree": (TF, "no such key: data-parallel ranks = torchrun's world size / "
                                                   "(tensor x pipeline x context parallel)"),
    # TRL GRPOConfig (flat keys)
    "learning_rate": (TRL, "use trainer.lr (sft.lr for the SFT warm start)"),
    "per_device_train_batch_size": (TRL, "use trainer.micro_batch_size"),
    "gradient_accumulation_steps": (TRL, _ACCUM),
    "num_generations": (TRL, "use grpo.n_samples"),
    "max_completion_length": (TRL, "use rollout.max_new_tokens"),
    "max_prompt_length": (TRL, "use data.max_prompt_len"),
    "seq_len": (TF, "use " + _SEQ),
    "beta": (TRL, "use grpo.beta"),
    "epsilon": (TRL, "use grpo.clip_low (the ratio's clip; AdamW's epsilon is trainer.eps)"),
    "epsilon_high": (TRL, "use grpo.clip_high"),
    "temperature": (TRL, "use grpo.temperature"),
    "num_iterations": (TRL, "use trainer.epochs"),
    "loss_type": (TRL, "use algo.loss_agg (grpo: seq_mean_token_mean, bnpo / dapo: token_mean, dr_grpo: "
                       "seq_mean_token_sum_norm with algo.advantage dr_grpo)"),
    "scale_rewards": (TRL, "use algo.advantage (grpo divides by the group's std, dr_grpo does not)"),
    "warmup_steps": (TRL, "use trainer.warmup_steps"),
    "lr_scheduler_type": (TRL, "use trainer.lr_schedule"),
    "weight_decay": (TRL, "use trainer.weight_decay"),
    "max_grad_norm": (TRL, "use trainer.grad_clip"),
    "adam_beta1": (TRL, "use trainer.betas"),
    "adam_beta2": (TRL, "use trainer.betas"),
    "adam_epsilon": (TRL, "use trainer.eps"),
    "bf16": (TRL, "use model.dtype bfloat16 (or trainer.autocast bfloat16 over float32 weights)"),
    "gradient_checkpointing": (TRL, "use trainer.gradient_checkpointing"),
    "num_train_epochs": (TRL, "use max_steps (RL steps)"),
    "use_vllm": (TRL, "use rollout.engine (embedded, embedded_server or sglang)"),
    "reward_funcs": (TRL, "use rewards.functions ([{name: math}, {name: 'my_pkg.rewards:fn'}])"),
    "reward_weights": (TRL, "use rewards.functions[].weight"),
    "save_steps": (TRL, "use checkpoint.interval"),
    "save_total_limit": (TRL, "use checkpoint.keep_last_n"),
    "report_to": (TRL, "use metrics.* (metrics.tensorboard, metrics.wandb)"),
    # verl (ppo_trainer.yaml)
    "data.train_batch_size": (VERL, "use rollout.batch_size (prompts per RL step)"),
    "data.max_prompt_length": (VERL, "use data.max_prompt_len"),
    "data.max_response_length": (VERL, "use rollout.max_new_tokens"),
    "data.train_files": (VERL, "use data.path"),
    "data.val_files": (VERL, "use eval.sets ([{name: val, path: ...}])"),
    "data.prompt_key": (VERL, "use data.input_key"),
    "actor_rollout_ref.model.path": (VERL, "use model.path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (VERL, "use trainer.gradient_checkpointing"),
    "actor_rollout_ref.actor.optim.lr": (VERL, "use trainer.lr"),
    "actor_rollout_ref.actor.optim.weight_decay": (VERL, "use trainer.weight_decay"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": (VERL, "use trainer.warmup_steps"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (VERL, "use trainer.mini_batches (a count: optimizer steps "
                                                          "per RL step, not a size)"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (VERL, "use trainer.micro_batch_size"),
    "actor_rollout_ref.actor.ppo_epochs": (VERL, "use trainer.epochs"),
    "actor_rollout_ref.actor.clip_ratio": (VERL, "use grpo.clip_low and grpo.clip_high"),
    "actor_rollout_ref.actor.clip_ratio_low": (VERL, "use grpo.clip_low"),
    "actor_rollout_ref.actor.clip_ratio_high": (VERL, "use grpo.clip_high"),
    "actor_rollout_ref.actor.clip_ratio_c": (VERL, "use algo.clip_c"),
    "actor_rollout_ref.actor.use_kl_loss": (VERL, "the KL is in the loss when grpo.beta > 0 (algo.kl_in_reward "
                                                  "false)"),
    "actor_rollout_ref.actor.kl_loss_coef": (VERL, "use grpo.beta"),
    "actor_rollout_ref.actor.kl_loss_type": (VERL, "use algo.kl_estimator"),
    "actor_rollout_ref.actor.entropy_coeff": (VERL, "use algo.entropy_coef"),
    "actor_rollout_ref.actor.loss_agg_mode": (VERL, "use algo.loss_agg"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": (VERL, "use algo.loss"),
    "actor_rollout_ref.actor.grad_clip": (VERL, "use trainer.grad_clip"),
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": (VERL, "use trainer.tensor_parallel"),
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": (VERL, "use trainer.pipeline_parallel"),
    "actor_rollout_ref.rollout.n": (VERL, "use grpo.n_samples"),
    "actor_rollout_ref.rollout.name": (VERL, "use rollout.engine"),
    "actor_rollout_ref.rollout.temperature": (VERL, "use grpo.temperature"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (VERL, "use rollout.tensor_parallel"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (VERL, "use rollout.mem_fraction"),
    "actor_rollout_ref.rollout.response_length": (VERL, "use rollout.max_new_tokens"),
    "algorithm.adv_estimator": (VERL, "use algo.advantage"),
    "algorithm.use_kl_in_reward": (VERL, "use algo.kl_in_reward"),
    "algorithm.kl_ctrl.kl_coef": (VERL, "use grpo.beta"),
    "algorithm.gamma": (VERL, "use algo.gamma"),
    "algorithm.lam": (VERL, "use algo.lam"),
    "algorithm.norm_adv_by_std_in_grpo": (VERL, "use algo.advantage (grpo divides by the std, dr_grpo does not)"),
    "trainer.total_training_steps": (VERL, "use max_steps"),
    "trainer.total_epochs": (VERL, "use max_steps (RL steps)"),
    "trainer.save_freq": (VERL, "use checkpoint.interval"),
    "trainer.test_freq": (VERL, "use eval.interval"),
    "trainer.n_gpus_per_node": (VERL, "torchrun --nproc_per_node (slurm.gpus_per_node under SLURM)"),
    "trainer.nnodes": (VERL, "torchrun --nnodes (slurm.nodes under SLURM)"),
    "trainer.project_name": (VERL, "use metrics.wandb_project"),
    "trainer.experiment_name": (VERL, "use run_name"),
    "trainer.default_local_dir": (VERL, "use output_dir"),
    "trainer.logger": (VERL, "use metrics.* (metrics.tensorboard, metrics.wandb)"),
    "critic.optim.lr": (VERL, "use critic.lr"),
    "critic.model.path": (VERL, "use critic.path"),
    "custom_reward_function.path": (VERL, "use rewards.functions[].name 'my_pkg.module:fn'"),
    "reward_model.model.path": (VERL, "use rewards.functions: [{name: reward_model, reward_model: {path: ...}}]"),
}
#: sections given a single value instead of a mapping: {section: the key the value belongs to}
SCALAR_SECTIONS = {"model": "model.path", "data": "data.path", "critic": "critic.path", "rewards": "rewards.functions"}


def _one(key: str) -> Optional[str]:
    hit = ALIASES.get(key) or ALIASES.get("actor_rollout_ref." + key)
    if hit is None and "." in key:
        leaf = ALIASES.get(key.rsplit(".", 1)[-1])
        hit = leaf if leaf is not None and leaf[0] == TRL else None
    return f"({hit[0]}'s key) {hit[1]}" if hit else None


def _children(key: str, value: dict) -> list[str]:
    out = []
    for k, v in value.items():
        sub = f"{key}.{k}"
        h = _one(sub)
        if h:
            out.append(f"{sub}: {h}")
        elif isinstance(v, dict):
            out.extend(_children(sub, v))
    return out


def hint(key: str, value: Any = None) -> Optional[str]:
    """The advice for unknown config ``key`` (holding ``value``), or None when no table knows it."""
    if isinstance(value, dict):
        kids = _children(key, value)
        if kids:
            return "; ".join(kids)
    return _one(key)


def scalar_hint(key: str, value: Any) -> Optional[str]:
    """Section ``key`` given ``value`` (not a mapping): the key that takes it, e.g. ``model: Qwen/X``."""
    if key in SCALAR_SECTIONS:
        return f"use {SCALAR_SECTIONS[key]}: {value!r} (--{SCALAR_SECTIONS[key]} {value}; torchforge's `{key}:` " \
               f"is a section here)"
    return None
