"""The whole configuration tree (:class:`Config`: the run's own keys and one field per section) and
the checks that span sections (Config.validate)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from megaforge.config.algo import GROUP_BASELINE_ADVANTAGES, AlgoConfig, CriticConfig, GRPOConfig
from megaforge.config.evaluation import EvalConfig
from megaforge.config.model import DataConfig, ModelConfig
from megaforge.config.rewards import RewardsConfig, check_reward_spec, reward_label
from megaforge.config.rollout import RolloutConfig, server_flags
from megaforge.config.teacher import TeacherConfig
from megaforge.config.run import (CheckpointConfig, LaunchConfig, LoopConfig, MemoryConfig, MetricsConfig,
                                  SlurmConfig, SyncConfig)
from megaforge.config.trainer import SFTConfig, TrainerConfig
from megaforge.configtree import ConfigError
from megaforge.engine_kinds import engine_kind, engine_kind_names


@dataclass
class Config:
    output_dir: str = "runs"
    """Runs are written to ``<output_dir>/<run_name>/``."""
    run_name: str = "run"
    """Name of the run directory."""
    max_steps: int = 10
    """RL steps."""
    seed: int = 0
    """Seed of data order, sampling and init."""
    resume: bool = False
    """Continue from the latest complete checkpoint in the run directory. The run folder's config.yaml is
    compared with this configuration first: every changed key is printed; changes that alter the run's
    steps (seed, data, model, grpo.n_samples, learning rate, ...) are refused unless named in
    resume_allow_changes (megaforge.resume)."""
    resume_allow_changes: str = ""
    """With ``resume``: the changed keys (or sections) to accept although the resumed run then differs
    from the run continued unchanged, comma-separated, e.g. ``trainer.lr,seed``."""
    export_hf_every: int = 0
    """Write a Hugging Face export to ``<run dir>/hf/step_N/`` every N steps (0: never)."""
    deterministic: bool = False
    """Use deterministic algorithms (CPU resume tests)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model and tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """RL prompts."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Group sampling and clipped objective (torchforge's ``grpo:`` block)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantage estimator, policy loss, aggregation, KL, corrections."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (PPO / gae)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation's frozen teacher (algo.advantage: distill)."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Reward functions."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engines and sampling."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Trainer backend, optimizer and parallel layout."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start (and the SFT launcher)."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    """Synchronous or off-policy loop."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight synchronisation."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Colocation memory management."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks and progress display."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation (greedy pass@1, sampled pass@k) during RL."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Distributed timeouts and the rank watchdog (megaforge.cluster)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """SLURM / submitit job (launchers/slurm.py)."""

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.run_name)

    @property
    def critic_enabled(self) -> bool:
        return self.critic.enabled if self.critic.enabled is not None else self.algo.advantage == "gae"

    def _validate_algo(self, need) -> None:
        a = self.algo
        need(a.mis_threshold_low is None or a.mis_threshold is not None, "algo.mis_threshold_low",
             "needs algo.mis_threshold (the upper bound)")
        need(a.mis_threshold is None or a.mis_threshold_low is None or a.mis_threshold_low < a.mis_threshold,
             "algo.mis_threshold_low", "must be < algo.mis_threshold")
        need(a.dynamic_sampling_max_rounds >= 1, "algo.dynamic_sampling_max_rounds", "must be >= 1")
        need(a.overlong_buffer >= 0, "algo.overlong_buffer", "must be >= 0")
        need(a.overlong_buffer < self.rollout.max_new_tokens or a.overlong_buffer == 0, "algo.overlong_buffer",
             f"must be < rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        need(not (a.kl_in_reward and self.grpo.beta > 0 and a.advantage in ("grpo", "dr_grpo", "rloo")),
             "algo.kl_in_reward", f"algo.advantage {a.advantage} uses sequence rewards only, so the KL penalty "
             "would be dropped: use reinforce_pp, reinforce_pp_baseline or gae, or keep the KL in the loss")
        need(not (a.advantage == "gae" and self.critic.enabled is False), "critic.enabled",
             "algo.advantage gae needs the critic (set critic.enabled true or null)")
        need(self.sft.pack_len >= 0, "sft.pack_len", "must be >= 0")
        need(self.grpo.n_samples > 1 or a.advantage not in GROUP_BASELINE_ADVANTAGES or self.max_steps == 0,
             "grpo.n_samples", f"algo.advantage {a.advantage} compares each response with the other responses to "
             f"its prompt, so with 1 sample per prompt every advantage is 0 and the policy cannot learn: set "
             f"grpo.n_samples >= 2 (or algo.advantage reinforce_pp, whose baseline is the batch's)")
        distill, tp = a.advantage == "distill", self.teacher
        need(not distill or bool(tp.path), "teacher.path",
             "algo.advantage distill needs a teacher: an HF model folder, a run folder or a run checkpoint")
        need(distill or not tp.path, "teacher.path",
             f"a teacher is set but algo.advantage is {a.advantage!r}: set algo.advantage distill (task reward "
             "combined through teacher.task_coef) or leave teacher.path empty")
        need(not distill or tp.kl_coef > 0 or tp.task_coef > 0, "teacher.kl_coef",
             "and teacher.task_coef are both 0: the advantage would be 0 everywhere")
        need(tp.served_by == "engine" or not tp.url, "teacher.url",
             "is the SGLang server of a teacher served by an engine: set teacher.served_by engine or leave it empty")
        need(not tp.url or tp.url.startswith(("http://", "https://")), "teacher.url",
             f"{tp.url!r} is not an http(s):// URL")
        need(not tp.url or self.grpo.temperature == 1.0, "teacher.url",
             f"SGLang's prompt log-probs are of the raw logits (temperature 1), the student's at grpo.temperature "
             f"{self.grpo.temperature}: set grpo.temperature 1.0, or serve the teacher with the embedded engine "
             "(teacher.url empty) or on the trainer (teacher.served_by trainer)")

    def _validate_rewards(self, need) -> None:
        r = self.rewards
        need(r.start_timeout_s > 0, "rewards.start_timeout_s", "must be > 0")
        need(r.stream_prompts >= 0, "rewards.stream_prompts", "must be >= 0 (0: rewards after generation)")
        labels: dict[str, int] = {}
        for i, spec in enumerate(r.functions):
            key = f"rewards.functions[{i}]"
            label = reward_label(spec)
            need(label not in labels, f"{key}.label", f"reward label {label!r} is already used by "
                 f"rewards.functions[{labels.get(label)}]: give each reward a label of its own")
            labels[label] = i
            check_reward_spec(spec, key, need)

    def _validate_loop(self, need) -> None:
        lp, a, r = self.loop, self.algo, self.rollout
        corrected = a.tis_cap is not None or a.mis_threshold is not None
        need(lp.max_staleness >= 0, "loop.max_staleness", "must be >= 0")
        updates = self.trainer.mini_batches * self.trainer.epochs
        need(lp.mode != "off_policy" or lp.max_staleness >= updates, "loop.max_staleness",
             f"must be >= trainer.mini_batches * trainer.epochs = {updates} in off_policy mode (one step of "
             f"overlap ages every sample by that many weight versions)")
        need(lp.mode != "off_policy" or not engine_kind(r.engine).in_process, "rollout.engine",
             "loop.mode off_policy overlaps generation with training, which needs the engine in its own "
             "process: set rollout.engine to embedded_server (CPU/dev) or sglang. The in-process embedded engine "
             "shares this process's cores and GIL (measured on CPU: no speed-up over sync)")
        need(lp.stale_policy != "correct" or corrected, "loop.stale_policy",
             "correct needs an importance-sampling correction: set algo.tis_cap or algo.mis_threshold")
        need(lp.partial_budget_tokens >= 0, "loop.partial_budget_tokens", "must be >= 0")
        need(not (lp.partial_rollouts and lp.partial_old_tokens == "correct") or corrected, "loop.partial_old_tokens",
             "correct needs an importance-sampling correction: set algo.tis_cap or algo.mis_threshold")
        need(not (lp.partial_rollouts and r.generate_fn), "loop.partial_rollouts",
             "partial rollouts continue single-turn generations; they do not combine with rollout.generate_fn")
        if r.return_routed_experts:
            need(self.trainer.backend == "megatron", "rollout.return_routed_experts",
                 "routing replay runs in megatron-core's router: set trainer.backend megatron (the torch backend's "
                 "HF modules cannot replay a routing)")
            need(self.trainer.recompute != "full", "rollout.return_routed_experts",
                 "does not combine with trainer.recompute full (the recomputed routers in backward would need the "
                 "routing of another micro-batch): set trainer.recompute none or selective")
            need(not r.generate_fn and not lp.partial_rollouts, "rollout.return_routed_experts",
                 "covers single-turn generations only: unset rollout.generate_fn and loop.partial_rollouts")
        need(r.max_turns >= 1, "rollout.max_turns", "must be >= 1")
        need(r.max_tool_tokens >= 1, "rollout.max_tool_tokens", "must be >= 1")

    def _validate_launch(self, need) -> None:
        la, sl = self.launch, self.slurm
        need(la.dist_timeout_s > 0, "launch.dist_timeout_s", "must be > 0")
        need(la.heartbeat_s > 0, "launch.heartbeat_s", "must be > 0")
        need(la.peer_timeout_s > 2 * la.heartbeat_s, "launch.peer_timeout_s", "must be > 2 x launch.heartbeat_s")
        need(la.abort_grace_s >= 0, "launch.abort_grace_s", "must be >= 0")
        need(sl.nodes >= 1, "slurm.nodes", "must be >= 1")
        need(sl.gpus_per_node >= 1, "slurm.gpus_per_node", "must be >= 1")
        need(sl.signal_delay_s >= 0 and sl.stop_grace_s >= 0, "slurm.signal_delay_s", "and slurm.stop_grace_s must be >= 0")
        need(sl.max_requeues >= 0, "slurm.max_requeues", "must be >= 0")
        need(0 <= sl.master_port < 65536, "slurm.master_port", "must be a port number (0: derived from the job id)")

    @property
    def engine_dtype(self) -> str:
        """The engines' parameter dtype: ``rollout.dtype``, ``model.dtype`` when it is auto."""
        return self.model.dtype if self.rollout.dtype == "auto" else self.rollout.dtype

    def validate(self) -> None:
        def need(cond: bool, key: str, msg: str):
            if not cond:
                raise ConfigError(f"config key '{key}': {msg}")

        need(self.max_steps >= 0, "max_steps", "must be >= 0")
        need(self.sft.max_steps >= 0, "sft.max_steps", "must be >= 0")
        need(self.grpo.n_samples >= 1, "grpo.n_samples", "must be >= 1")
        self._validate_algo(need)
        need(self.rewards.timeout_s > 0, "rewards.timeout_s", "must be > 0 (seconds a step's reward calls get)")
        need(self.rewards.workers >= 0, "rewards.workers", "must be >= 0 (0: one per CPU core, at most 4)")
        self._validate_rewards(need)
        need(self.rollout.batch_size >= 1, "rollout.batch_size", "must be >= 1")
        need(self.rollout.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        need(self.rollout.max_restarts >= 0, "rollout.max_restarts", "must be >= 0")
        try:
            server_flags(self.rollout.extra_args)
        except ValueError as e:  # "rollout.extra_args: <what>"
            need(False, "rollout.extra_args", str(e).split(": ", 1)[1])
        need(self.trainer.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
        need(self.trainer.mini_batches >= 1, "trainer.mini_batches", "must be >= 1")
        need(self.trainer.epochs >= 1, "trainer.epochs", "must be >= 1")
        need(self.trainer.autocast == "off" or self.trainer.backend == "torch", "trainer.autocast",
             "is the torch backend's (megatron computes in model.dtype, with trainer.fp8 for FP8)")
        for k in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel", "expert_tensor_parallel"):
            need(getattr(self.trainer, k) >= 1, f"trainer.{k}", "must be >= 1")
        need(
            not self.trainer.sequence_parallel or self.trainer.tensor_parallel > 1,
            "trainer.sequence_parallel", "needs trainer.tensor_parallel > 1",
        )
        if engine_kind(self.rollout.engine).in_process:  # the transport must fit where the engine runs
            need(self.sync.transport in ("auto", "inproc"), "sync.transport",
                 f"{self.sync.transport!r} is for engines in other processes (sglang, embedded_server); rollout.engine "
                 f"{self.rollout.engine!r} takes the trainer's weights in its own process: set sync.transport auto (or inproc)")
        else:
            need(self.sync.transport != "inproc", "sync.transport",
                 f"'inproc' needs rollout.engine: embedded (rollout.engine {self.rollout.engine!r} runs in other "
                 "processes): set sync.transport auto, ipc, shm, disk or nccl")
        need(self.sync.bucket_mb >= 1, "sync.bucket_mb", "must be >= 1")
        need(self.sync.interval >= 1, "sync.interval", "must be >= 1")
        self._validate_loop(need)
        need(self.checkpoint.keep_last_n >= 1, "checkpoint.keep_last_n", "must be >= 1")
        self._validate_launch(need)
        self.eval.validate_with(self, need)
        if self.model.lora is not None:
            if self.trainer.backend == "megatron":  # megaforge.trainer.megatron.lora: megatron's own parallel linears
                need(self.trainer.layer_spec != "te", "model.lora",
                     "with trainer.backend megatron needs trainer.layer_spec torch (or auto): the adapters wrap "
                     "megatron's own parallel linears, not Transformer Engine's (trainer.layer_spec te)")
                need(not self.trainer.fp8, "model.lora",
                     f"with trainer.backend megatron has no FP8 path: set trainer.fp8 null (got {self.trainer.fp8!r})")
            need(not self.critic_enabled, "model.lora", "the PPO critic (critic.enabled / algo.advantage gae) "
                 "copies the policy's backbone, which LoRA does not train: use a critic-free advantage (grpo, rloo, ...)")
            need(len(self.model.lora.target_modules) > 0, "model.lora.target_modules", "must name at least one module")
        if self.sync.lora_adapters:
            need(self.model.lora is not None, "sync.lora_adapters", "needs model.lora (there are no adapters to send)")
            takes = [n for n in engine_kind_names() if engine_kind(n).lora_adapters]
            need(bool(engine_kind(self.rollout.engine).lora_adapters), "sync.lora_adapters",
                 f"rollout.engine {self.rollout.engine!r} takes the merged weights only (adapters alone: "
                 f"{', '.join(takes)}): set it false")
            need(not self.sync.check_equal, "sync.check_equal", "compares merged tensors, which sync.lora_adapters "
                 "does not send: set one of them false")
        need(bool(self.model.path or self.model.config), "model.path", "set model.path (or model.config for a random init)")
        need(bool(self.data.path) or self.max_steps == 0, "data.path", "set the RL prompt data")
        need(self.run_name not in ("", ".", "..") and "/" not in self.run_name, "run_name", "must be a plain folder name")
