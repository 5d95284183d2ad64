"""The build step: :class:`RunBuilder` is the one place that reads the whole configuration tree and
turns it into a run's components (trainer, engines, rewards, prompt data, evaluation, step driver),
each given only its own section(s) or a spec of :mod:`megaforge.specs` (issue 42).

    b = RunBuilder(cfg)
    trainer = b.trainer(tokenizer)                  # trainer.backend, built from b.trainer_spec()
    engine  = b.engines(tokenizer, job)             # rollout.engine, placed over the job's GPUs
    rewards = b.rewards()                           # rewards, algo.plugins
    data    = b.prompts(tokenizer, exclude)         # data, seed
    parts   = b.step_parts(trainer, engine, data, rewards, tokenizer, stop_ids)   # StepSettings
    driver  = b.driver(parts, state, resumed_from)  # loop.mode, loop.partial_rollouts, sync.interval
    plan    = b.plan_input()                        # what the dry-run planner and the engine placement read

The launcher (megaforge.launch) builds the dry run's :meth:`plan_input` here, and the library API's
public functions (megaforge.api) are thin calls into ``library_*``, :meth:`generate` and the others.
The components below it take sections and specs, and :func:`megaforge.specs.expect` guards the specs'
entry points; ``tests/test_config_ownership.py`` counts the functions that still take the whole tree
(at most 10 apart from megaforge.api's public ones).
"""
from __future__ import annotations

from typing import Optional

from megaforge.config import Config
from megaforge.specs import (EngineSpec, EvalSettings, GenerateContext, PlanInput, Sampling, Schedule, StepSettings,
                             TrainerSpec, expect)


class RunBuilder:
    """Builds a run's components from ``cfg`` (a checked :class:`~megaforge.config.Config`). Each method
    reads the keys its docstring names and nothing else reaches the component."""

    def __init__(self, cfg: Config):
        self.cfg = expect(cfg, Config, "RunBuilder")

    # ------------------------------------------------------------------------------------ specs
    def sampling(self) -> Sampling:
        """grpo.temperature, rollout.top_p / top_k / max_new_tokens / stop."""
        r = self.cfg.rollout
        return Sampling(temperature=self.cfg.grpo.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_new_tokens=r.max_new_tokens, stop=tuple(r.stop))

    def generate_context(self) -> Optional[GenerateContext]:
        """What ``rollout.generate_fn`` is given (None when it is not set)."""
        c, r = self.cfg, self.cfg.rollout
        if not r.generate_fn:
            return None
        return GenerateContext(generate_fn=r.generate_fn, max_new_tokens=r.max_new_tokens, max_turns=r.max_turns,
                               max_tool_tokens=r.max_tool_tokens, n_samples=c.grpo.n_samples,
                               temperature=c.grpo.temperature, seed=c.seed, model_path=c.model.path,
                               generate_kwargs=dict(r.generate_kwargs))

    def engine_spec(self) -> EngineSpec:
        """What the engine kinds build from: the ``rollout`` and ``model`` sections, the engines' dtype,
        ``seed``, the run directory, ``sync.transport``, ``sync.lora_adapters``."""
        c = self.cfg
        return EngineSpec(rollout=c.rollout, model=c.model, dtype=c.engine_dtype, seed=c.seed, run_dir=c.run_dir,
                          transport=c.sync.transport, lora_adapters=c.sync.lora_adapters)

    def plan_input(self) -> PlanInput:
        """What the dry-run planner and the engine placement read (:class:`~megaforge.specs.PlanInput`);
        its ``vary`` rebuilds it from this tree with dotted overrides (checked as a loaded config is)."""
        c = self.cfg

        def vary(overrides: dict) -> Optional[PlanInput]:
            from megaforge import configtree

            tree = configtree.to_dict(c)
            for k, v in overrides.items():
                configtree.set_dotted(tree, k, v)
            try:
                alt = configtree.build(Config, tree)
            except configtree.ConfigError:
                return None
            return RunBuilder(alt).plan_input()

        return PlanInput(model=c.model, trainer=c.trainer, rollout=c.rollout, data=c.data, sft=c.sft, grpo=c.grpo,
                         algo=c.algo, loop=c.loop, memory=c.memory, sync=c.sync, teacher=c.teacher, max_steps=c.max_steps,
                         critic_enabled=c.critic_enabled, engine_dtype=c.engine_dtype, vary=vary)

    def preflight(self) -> None:
        """The engines' start-up checks (:func:`megaforge.rollout.preflight`) with :meth:`engine_spec` and the
        ``data`` / ``eval`` sections."""
        from megaforge.rollout import preflight

        preflight(self.engine_spec(), self.cfg.data, self.cfg.eval)

    def objective(self):
        """The objective's parameters (algo.*, grpo.*, teacher.*; algo.plugins imported)."""
        from megaforge.algorithms import ObjectiveParams  # lazy: torch

        c = self.cfg
        return ObjectiveParams.from_sections(c.algo, c.grpo, c.teacher, c.rollout.max_new_tokens)

    def step_settings(self) -> StepSettings:
        """What the step primitives and the drivers read (:class:`~megaforge.specs.StepSettings`)."""
        c = self.cfg
        t, a = c.trainer, c.algo
        return StepSettings(
            objective=self.objective(), sampling=self.sampling(), loop=c.loop, generate=self.generate_context(),
            mini_batches=t.mini_batches, epochs=t.epochs, beta=c.grpo.beta, n_samples=c.grpo.n_samples,
            advantage=a.advantage, kl_in_reward_key=a.kl_in_reward, kl_estimator=a.kl_estimator,
            critic=c.critic_enabled, dynamic_sampling=a.dynamic_sampling,
            dynamic_sampling_max_rounds=a.dynamic_sampling_max_rounds, overlong_buffer=a.overlong_buffer,
            overlong_penalty=a.overlong_penalty, batch_size=c.rollout.batch_size,
            max_new_tokens=c.rollout.max_new_tokens, request_timeout_s=c.rollout.request_timeout_s,
            stream_prompts=c.rewards.stream_prompts, sync_interval=c.sync.interval, bucket_mb=c.sync.bucket_mb,
            check_equal=c.sync.check_equal, lora_adapters=c.sync.lora_adapters, log_samples=c.metrics.log_samples,
            seed=c.seed, max_steps=c.max_steps)

    def eval_settings(self) -> EvalSettings:
        """What the evaluator and its schedule read (:class:`~megaforge.specs.EvalSettings`)."""
        from megaforge.config.evaluation import correct_reward_label

        c = self.cfg
        return EvalSettings(eval=c.eval, sampling=self.sampling(), generate=self.generate_context(),
                            max_steps=c.max_steps, per_step_requests=c.rollout.batch_size * c.grpo.n_samples,
                            seed=c.seed, correct_name=correct_reward_label(c.eval, c.rewards))

    def trainer_spec(self) -> TrainerSpec:
        """What the trainer backends build from (:class:`~megaforge.specs.TrainerSpec`): the ``trainer``,
        ``model``, ``teacher``, ``critic``, ``checkpoint``, ``memory``, ``sft``, ``grpo``, ``rollout``
        sections, ``max_steps``, ``seed`` and :meth:`objective`."""
        c = self.cfg
        return TrainerSpec(trainer=c.trainer, model=c.model, teacher=c.teacher, critic=c.critic,
                           checkpoint=c.checkpoint, memory=c.memory, sft=c.sft, grpo=c.grpo, rollout=c.rollout,
                           objective=self.objective(), max_steps=c.max_steps, seed=c.seed)

    def schedule(self) -> Schedule:
        """The RL phase's schedule: trainer.lr / min_lr / warmup_steps / lr_schedule over max_steps x
        trainer.mini_batches x trainer.epochs updates."""
        c, t = self.cfg, self.cfg.trainer
        return Schedule(lr=t.lr, total_updates=c.max_steps * t.mini_batches * t.epochs, warmup_steps=t.warmup_steps,
                        lr_schedule=t.lr_schedule, min_lr=t.min_lr)

    # ------------------------------------------------------------------------------- components
    def distributed(self, job=None) -> None:
        """This process in the job's process group (torchrun's variables; none for one process):
        ``launch.*``, the device of ``trainer.device``; ``job``: the rank watchdog's (megaforge.cluster)."""
        from megaforge.cluster import init_distributed  # lazy: torch
        from megaforge.hf import resolve_device

        init_distributed(self.cfg.launch, resolve_device(self.cfg.trainer.device).type, job)

    def load_tokenizer(self):
        """The policy's tokenizer (``model.tokenizer``, else ``model.path``)."""
        from megaforge.hf import load_tokenizer  # lazy: transformers

        return load_tokenizer(self.cfg.model)

    def resolve_offload(self) -> Optional[str]:
        """``memory.offload: auto`` decided for this machine and written into the config's ``memory``
        section (the trainer reads it from there), printed with its reason; other values are kept.
        A trainer off CUDA: none. On CUDA: :func:`megaforge.planner.report.decide_offload` with this GPU's
        memory and the job's nodes x GPUs (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE). Returns the reason
        (None when nothing was decided)."""
        m = self.cfg.memory
        if m.offload != "auto":
            return None
        import os
        import sys

        from megaforge.hf import resolve_device

        device = resolve_device(self.cfg.trainer.device)
        if device.type != "cuda":
            resolved, why = "none", f"the trainer runs on {device.type}: its state lives in host memory already"
        else:
            import torch

            from megaforge.planner.report import decide_offload

            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            opts = {"gpu": torch.cuda.get_device_name(device),
                    "gpu_memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
                    "nodes": max(1, int(os.environ.get("WORLD_SIZE", "1")) // local), "gpus_per_node": local}
            resolved, why = decide_offload(self.plan_input(), "grpo", opts)
        m.offload = resolved
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[megaforge] memory.offload auto -> {resolved}: {why}", file=sys.stderr, flush=True)
        return why

    def trainer(self, tokenizer=None):
        """The configured backend (``trainer.backend``), constructed on every rank (``memory.offload:
        auto`` decided first: :meth:`resolve_offload`)."""
        self.resolve_offload()
        backend = self.cfg.trainer.backend
        if backend == "torch":
            from megaforge.trainer.torch_backend import TorchTrainer  # lazy: the chosen backend only

            return TorchTrainer(self.trainer_spec(), tokenizer)
        if backend == "megatron":
            try:
                from megaforge.trainer.megatron import MegatronTrainer  # lazy: megatron-core is optional
            except ImportError as e:
                raise RuntimeError(
                    f"trainer.backend: megatron needs megatron-core (pip install 'megaforge[megatron]'): {e}") from e
            return MegatronTrainer(self.trainer_spec(), tokenizer)
        raise ValueError(f"unknown trainer.backend {backend!r}; valid: torch, megatron")

    def library_trainer(self, tokenizer=None, rl: bool = True):
        """:func:`megaforge.api.build_trainer`: the process group, :meth:`trainer` (the tokenizer loaded
        when not given), then (``rl``) :meth:`start_rl_trainer`."""
        self.distributed()
        trainer = self.trainer(tokenizer if tokenizer is not None else self.load_tokenizer())
        if rl:
            self.start_rl_trainer(trainer)
        return trainer

    def library_engine(self, tokenizer=None):
        """:func:`megaforge.api.build_engine`: the process group, :meth:`preflight`, :meth:`engines`."""
        self.distributed()
        self.preflight()
        return self.engines(tokenizer if tokenizer is not None else self.load_tokenizer())

    def library_parts(self, trainer=None, engine=None, rewards=None):
        """The step primitives :func:`megaforge.api.train_step` / :func:`~megaforge.api.push_weights` call:
        :class:`~megaforge.driver.steps.StepParts` with :meth:`step_settings` and no data (the API's
        steps are the caller's, so ``loop.partial_rollouts`` is refused)."""
        from megaforge.configtree import ConfigError
        from megaforge.driver.steps import StepParts  # lazy: torch

        if self.cfg.loop.partial_rollouts:
            raise ConfigError("loop.partial_rollouts carries samples between a run's steps; the API's steps are "
                              "yours: set it false")
        return StepParts(self.step_settings(), trainer, engine, None, rewards, None, [])

    def prompt_rows(self, tokenizer, prompts, labels=None) -> list:
        """Prompt rows of ``prompts`` through the ``data`` section's chat template
        (:func:`megaforge.data.prompts.rows_from_prompts`)."""
        from megaforge.data.prompts import rows_from_prompts  # lazy: torch

        return rows_from_prompts(tokenizer, prompts, self.cfg.data, labels)

    def generate(self, engine, tokenizer, rows, step: int = 1, n: Optional[int] = None, stop_ids=None) -> list:
        """``n`` (default ``grpo.n_samples``) samples of each row with :meth:`sampling`, seeded by ``seed``
        and ``step``, through :meth:`generate_context` (``rollout.generate_fn``) when it is set; the stop
        tokens of ``model.path``'s chat template unless ``stop_ids`` are given."""
        from megaforge.rollout.manager import generate_samples, stop_token_ids  # lazy: torch

        c = self.cfg
        stops = stop_ids if stop_ids is not None else stop_token_ids(tokenizer, c.model.path)
        return generate_samples(engine, rows, n or c.grpo.n_samples, self.sampling().params(stops), c.seed, step, 0,
                                tokenizer, self.generate_context())

    def start_rl_trainer(self, trainer) -> None:
        """The trainer as RL starts: :func:`megaforge.driver.steps.start_rl_trainer` with :meth:`schedule`
        and the reference when grpo.beta > 0."""
        from megaforge.driver.steps import start_rl_trainer

        start_rl_trainer(trainer, self.schedule(), reference=self.cfg.grpo.beta > 0)

    def engines(self, tokenizer, job=None):
        """The rollout engine(s) (``rollout.engine``; rank 0's, None elsewhere; node leaders start their
        node's servers), built by the kind from :meth:`engine_spec`; a multi-node job's engine GPUs come
        from the planner's placement of :meth:`plan_input` (:func:`megaforge.placement.engine_slots`)."""
        from megaforge.placement import build_engines, engine_slots  # lazy: torch

        return build_engines(self.engine_spec(), tokenizer, job, slots=lambda place: engine_slots(self.plan_input(), place))

    def rewards(self):
        """The reward manager: the ``rewards`` section and ``algo.plugins`` (plug-in rewards)."""
        from megaforge.rewards import RewardManager

        return RewardManager(self.cfg.rewards, self.cfg.algo.plugins)

    def prompts(self, tokenizer, exclude=frozenset()):
        """The RL prompts: the ``data`` section, ``seed``; ``exclude``: the eval sets' held-out prompts."""
        from megaforge.data.prompts import PromptSource  # lazy: torch

        return PromptSource(self.cfg.data, tokenizer, self.cfg.seed, exclude=exclude)

    def sft_prompts(self, tokenizer, exclude=frozenset()):
        """The SFT rows: ``sft.data`` (else ``data``; the held-out prompts excluded from the latter), ``seed``."""
        from megaforge.data.prompts import PromptSource  # lazy: torch

        c = self.cfg
        data = c.sft.data or c.data
        return PromptSource(data, tokenizer, c.seed, want_response=True,
                            exclude=exclude if data is c.data else frozenset())

    def eval_sets(self, tokenizer):
        """(sets, held-out prompts) of ``eval.sets``: reads the ``eval`` and ``data`` sections, ``seed``,
        ``sft.data`` when ``sft.max_steps`` > 0 (checked disjoint from the sets)."""
        from megaforge.eval.sets import load_eval_sets  # lazy: torch

        c = self.cfg
        return load_eval_sets(c.eval, c.data, c.seed, tokenizer, c.sft.data if c.sft.max_steps > 0 else None)

    def evaluator(self, settings: Optional[EvalSettings], sets, tokenizer, rewards, stop_ids,
                  out_dir: Optional[str] = None):
        """The evaluator of ``sets`` with ``settings`` (None: :meth:`eval_settings`)."""
        from megaforge.eval.runner import Evaluator  # lazy: torch

        return Evaluator(settings or self.eval_settings(), sets, tokenizer, rewards, stop_ids, out_dir)

    def routing_shape(self):
        """The policy's routing shape with ``rollout.return_routed_experts`` (None: off); reads ``model``."""
        from megaforge.rollout.routing import run_routing_shape  # lazy: torch

        return run_routing_shape(self.cfg.rollout.return_routed_experts, self.cfg.model)

    def step_parts(self, trainer, engine, data, rewards, tokenizer, stop_ids):
        """The step primitives over the run's parts (:class:`~megaforge.driver.steps.StepParts`), with
        :meth:`step_settings`, the routing shape and (``loop.partial_rollouts``) the partial-rollout pool."""
        from megaforge.driver.steps import StepParts  # lazy: torch

        return StepParts(self.step_settings(), trainer, engine, data, rewards, tokenizer, stop_ids,
                         routing_shape=self.routing_shape())

    def driver(self, parts, state: dict, resumed_from: Optional[str] = None):
        """:class:`~megaforge.driver.offpolicy.AsyncDriver` when the settings need it, else
        :class:`~megaforge.driver.sync.SyncDriver`."""
        from megaforge.driver.offpolicy import AsyncDriver  # lazy: torch
        from megaforge.driver.sync import SyncDriver

        if parts.settings.is_async:
            return AsyncDriver(parts, state, resumed_from)
        return SyncDriver(parts, state.get("data"))

    def metrics_logger(self, run_dir: str, filename: str = "metrics.jsonl", resume_step: Optional[int] = None,
                       tb_subdir: str = "tensorboard"):
        """The metric sinks: the ``metrics`` section; ``run_name`` and the flattened tree for wandb's run."""
        from megaforge.metrics import MetricsLogger, flat_config

        c = self.cfg
        return MetricsLogger(c.metrics, run_dir, filename, resume_step, tb_subdir, run_name=c.run_name,
                             flat=flat_config(c) if c.metrics.wandb else None)
