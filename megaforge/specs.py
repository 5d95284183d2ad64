"""What a component needs of the configuration when it spans sections: small typed, frozen objects
that :class:`megaforge.build.RunBuilder` (the one place that reads the whole tree) fills in and hands
over, instead of the whole :class:`~megaforge.config.Config` (issue 42). A component that reads a
single section takes that section (``cfg.data``: a :class:`~megaforge.config.DataConfig`); these are
for the rest. Each docstring lists the config keys its fields hold.

:func:`expect` is the guard at the entry of a component that takes one of them (verl's check of the
params object): the wrong object (the whole Config, a config section, another spec) fails at once with
a TypeError naming the class expected, not later with an AttributeError deep in a step.

This module is light (no torch): the launcher and the planner import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from megaforge.algorithms.params import ObjectiveParams
    from megaforge.types import SamplingParams

#: where a generate_fn's context is documented (named by its AttributeError)
GENERATE_FN_DOCS = "megaforge/rollout/agent/multiturn.py (the module docstring) and examples/tool_use/README.md"


def expect(obj: Any, cls: type, where: str):
    """``obj`` when it is a ``cls``; else TypeError naming ``where`` (the receiving function), the class
    expected and the one given (the whole Config given where a spec is expected says so)."""
    if isinstance(obj, cls):
        return obj
    got = type(obj).__name__
    hint = ""
    if got == "Config":
        hint = (f"; the whole configuration is read in one place only (megaforge.build.RunBuilder), which "
                f"builds the {cls.__name__}")
    raise TypeError(f"{where}: expected a {cls.__module__}.{cls.__name__}, got a {got}{hint}")


def _names(cls) -> str:
    return ", ".join(f.name for f in fields(cls))


class _NamedFields:
    """For the specs that replace the whole configuration: an attribute the dataclass does not have (the
    old ``cfg.data``, ``spec.sync``...) raises AttributeError naming the class, the attribute and the
    fields. ``_missing``: the rest of the message, with ``{fields}`` for the field list."""

    _missing = ""

    def __getattr__(self, name: str):
        # only called for a name the dataclass does not have
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(self)
        raise AttributeError(f"{cls.__name__} has no attribute {name!r}: " + cls._missing.format(fields=_names(cls)))


@dataclass(frozen=True)
class Sampling:
    """A training step's sampling (each request's seed is added per request).

    Reads: ``grpo.temperature``, ``rollout.top_p``, ``rollout.top_k``, ``rollout.max_new_tokens``,
    ``rollout.stop``."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: tuple[str, ...] = ()

    def params(self, stop_ids, temperature: Optional[float] = None,
               max_new_tokens: Optional[int] = None) -> "SamplingParams":
        """The engine's SamplingParams with the end-of-turn ``stop_ids``; ``temperature`` 0 is greedy
        (top_p 1, top_k -1); ``max_new_tokens`` (e.g. ``eval.max_new_tokens``) replaces the step's."""
        from megaforge.types import SamplingParams  # lazy: torch

        t = self.temperature if temperature is None else temperature
        greedy = t == 0
        return SamplingParams(temperature=t, top_p=1.0 if greedy else self.top_p, top_k=-1 if greedy else self.top_k,
                              max_new_tokens=max_new_tokens or self.max_new_tokens, stop_token_ids=list(stop_ids),
                              stop=list(self.stop))


@dataclass(frozen=True)
class GenerateContext(_NamedFields):
    """What a user ``rollout.generate_fn`` is given of the run, in place of the whole configuration
    (its 5th argument): ``fn(engine, requests, rows, tokenizer, ctx, **rollout.generate_kwargs)``.

    Reads: ``rollout.generate_fn`` (``generate_fn``), ``rollout.max_new_tokens`` (the response budget of
    an episode), ``rollout.max_turns``, ``rollout.max_tool_tokens``, ``grpo.n_samples`` (samples per
    prompt row: sample k belongs to ``rows[k // n_samples]``), ``grpo.temperature``, ``seed``,
    ``model.path`` (``model_path``: e.g. the model name an OpenAI client sends),
    ``rollout.generate_kwargs`` (``generate_kwargs``: also passed as the function's keyword arguments).
    Anything else a function needs comes through ``rollout.generate_kwargs``. Another attribute (``ctx.data``,
    ``ctx.rollout``: the old whole-config argument) raises AttributeError listing these fields."""

    generate_fn: str = ""
    max_new_tokens: int = 128
    max_turns: int = 4
    max_tool_tokens: int = 64
    n_samples: int = 1
    temperature: float = 1.0
    seed: int = 0
    model_path: str = ""
    generate_kwargs: dict = field(default_factory=dict)

    _missing = ("a rollout.generate_fn receives a GenerateContext (fields: {fields}), not the whole configuration; "
                f"pass anything else through rollout.generate_kwargs (see {GENERATE_FN_DOCS})")


def engine_dtype(rollout, model) -> str:
    """The engines' parameter dtype: ``rollout.dtype``, ``model.dtype`` when it is auto."""
    return model.dtype if rollout.dtype == "auto" else rollout.dtype


@dataclass(frozen=True)
class EngineSpec(_NamedFields):
    """What a rollout engine kind builds its engine(s) from: ``build(spec, tokenizer, node=None)`` and
    ``preflight(spec)`` of :mod:`megaforge.engine_kinds`, and the server start-up below them.

    Reads: the ``rollout`` section (``rollout``), the ``model`` section (``model``), ``rollout.dtype``
    with ``model.dtype`` (``dtype``: :func:`engine_dtype`), ``seed``, ``output_dir`` / ``run_name``
    (``run_dir``: the servers' logs go to ``<run_dir>/logs``), ``sync.transport`` (``transport``),
    ``sync.lora_adapters`` (``lora_adapters``). Another attribute (``spec.sync``, ``spec.data``: the
    whole configuration, which kinds got before) raises AttributeError listing these fields."""

    rollout: Any
    model: Any
    dtype: str = "float32"
    seed: int = 0
    run_dir: str = ""
    transport: str = "auto"
    lora_adapters: bool = False

    _missing = ("an engine kind's build / preflight receives an EngineSpec (fields: {fields}), not the whole "
                "configuration (megaforge.engine_kinds)")


@dataclass(frozen=True)
class StepSettings:
    """What the RL step primitives (:class:`megaforge.driver.steps.StepParts`) and the drivers read.

    Reads: ``trainer.mini_batches``, ``trainer.epochs``, ``grpo.beta``, ``grpo.n_samples``,
    ``algo.advantage``, ``algo.kl_in_reward``, ``algo.kl_estimator``, ``algo.dynamic_sampling``,
    ``algo.dynamic_sampling_max_rounds``, ``algo.overlong_buffer``, ``algo.overlong_penalty``,
    ``critic.enabled`` (with ``algo.advantage``: ``critic``), ``rollout.batch_size``,
    ``rollout.max_new_tokens``, ``rollout.request_timeout_s``, ``rewards.stream_prompts``, the ``loop``
    section (``loop``: its LoopConfig), ``sync.interval``, ``sync.bucket_mb``, ``sync.check_equal``,
    ``sync.lora_adapters``,
    ``metrics.log_samples``, ``seed``, ``max_steps``; ``objective``: the
    :class:`~megaforge.algorithms.params.ObjectiveParams` (``algo.*``, ``grpo.*``, ``teacher.*``);
    ``sampling``: :class:`Sampling`; ``generate``: the :class:`GenerateContext` (None without
    ``rollout.generate_fn``)."""

    objective: "ObjectiveParams"
    sampling: Sampling
    loop: Any  # the LoopConfig section
    generate: Optional[GenerateContext] = None
    mini_batches: int = 1
    epochs: int = 1
    beta: float = 0.0
    n_samples: int = 1
    advantage: str = "grpo"
    kl_in_reward_key: bool = False
    kl_estimator: str = "k1"
    critic: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 1
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    batch_size: int = 1
    max_new_tokens: int = 128
    request_timeout_s: float = 600.0
    stream_prompts: int = 0
    sync_interval: int = 1
    bucket_mb: int = 512
    check_equal: bool = False
    lora_adapters: bool = False
    log_samples: int = 1
    seed: int = 0
    max_steps: int = 0

    @property
    def needs_ref(self) -> bool:
        """The step computes the reference policy's log-probs (the KL term: ``grpo.beta`` > 0)."""
        return self.beta > 0

    @property
    def kl_in_reward(self) -> bool:
        """The KL to the reference is a per-token reward penalty (``algo.kl_in_reward`` with beta > 0)."""
        return self.kl_in_reward_key and self.beta > 0

    @property
    def needs_teacher(self) -> bool:
        """The step computes the distillation teacher's log-probs (``algo.advantage: distill``)."""
        return self.advantage == "distill"

    @property
    def needs_old_logprobs(self) -> bool:
        """The trainer computes pi_old's log-probs before the update: several updates per batch (the ratio
        needs a fixed pi_old), the KL penalty in the reward, or distillation (both are taken from them)."""
        return self.mini_batches * self.epochs > 1 or self.kl_in_reward or self.needs_teacher

    @property
    def advantages_need_trainer(self) -> bool:
        """The advantages read per-token results of the trainer (the KL penalty in the reward, critic
        values, the teacher's log-probs), so every rank computes them on its own share after the
        log-probs / values; otherwise the main rank computes them on the whole batch before the hand-off."""
        return self.kl_in_reward or self.critic or self.needs_teacher

    @property
    def is_async(self) -> bool:
        """The steps need :class:`~megaforge.driver.offpolicy.AsyncDriver`: ``loop.mode: off_policy``,
        ``loop.partial_rollouts`` or ``sync.interval`` > 1."""
        return self.loop.mode == "off_policy" or self.loop.partial_rollouts or self.sync_interval > 1

    @property
    def updates(self) -> int:
        """Optimizer updates per step: ``trainer.mini_batches`` x ``trainer.epochs``."""
        return self.mini_batches * self.epochs


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluator (:class:`megaforge.eval.runner.Evaluator`) and its schedule read.

    Reads: ``eval.*`` (the section, ``eval``), ``max_steps``, ``rollout.batch_size`` and
    ``grpo.n_samples`` (a training step's requests: the evaluation's per-call size),
    ``grpo.temperature`` (the sampled mode's default), ``seed``, the reward label deciding correctness
    (``eval.correct_reward``, else the first of ``rewards.functions``: ``correct_name``); ``sampling``:
    :class:`Sampling`; ``generate``: :class:`GenerateContext` (None without ``rollout.generate_fn``)."""

    eval: Any  # the EvalConfig section (its sets are lists: not frozen, not copied)
    sampling: Sampling
    generate: Optional[GenerateContext] = None
    max_steps: int = 0
    per_step_requests: int = 1
    seed: int = 0
    correct_name: Optional[str] = None

    def is_due(self, step: int) -> bool:
        """Whether the run evaluates after RL step ``step`` (0: before the first step): eval.before_train
        at 0, then every eval.interval steps and after the last step (max_steps)."""
        e = self.eval
        if not e.sets:
            return False
        if step == 0:
            return e.before_train
        return e.interval > 0 and (step % e.interval == 0 or step == self.max_steps)


@dataclass(frozen=True)
class Schedule:
    """The RL phase's optimizer schedule (:func:`megaforge.driver.steps.start_rl_trainer`).

    Reads: ``trainer.lr``, ``trainer.min_lr``, ``trainer.warmup_steps``, ``trainer.lr_schedule``, and
    ``max_steps`` x ``trainer.mini_batches`` x ``trainer.epochs`` (``total_updates``)."""

    lr: float
    total_updates: int
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr: float = 0.0


@dataclass(frozen=True)
class PlanInput(_NamedFields):
    """What the dry-run planner (:mod:`megaforge.planner`) and the multi-node engine placement
    (:func:`megaforge.placement.engine_slots`) read, built once by
    :meth:`megaforge.build.RunBuilder.plan_input`.

    Reads: the ``model``, ``trainer``, ``rollout``, ``data``, ``sft``, ``grpo``, ``algo``, ``loop``,
    ``memory``, ``sync`` and ``teacher`` sections, ``max_steps``, ``critic.enabled`` with ``algo.advantage``
    (``critic_enabled``), ``rollout.dtype`` with ``model.dtype`` (``engine_dtype``). ``vary``: the same
    input with dotted config overrides applied and checked as the configuration checks them (None when
    they make it invalid): the planner's knobs try one change at a time through it."""

    model: Any
    trainer: Any
    rollout: Any
    data: Any
    sft: Any
    grpo: Any
    algo: Any
    loop: Any
    memory: Any
    sync: Any
    teacher: Any
    max_steps: int = 0
    critic_enabled: bool = False
    engine_dtype: str = "float32"
    vary: Optional[Callable[[dict], Optional["PlanInput"]]] = field(default=None, compare=False, repr=False)

    _missing = ("the planner receives a PlanInput (fields: {fields}), not the whole configuration "
                "(megaforge.build.RunBuilder.plan_input)")


@dataclass(frozen=True)
class TrainerSpec(_NamedFields):
    """What a trainer backend (:class:`megaforge.trainer.base.Trainer`: the torch and megatron backends)
    is built from and reads for the rest of the run (it keeps it as ``trainer.cfg``), built by
    :meth:`megaforge.build.RunBuilder.trainer_spec`. The sections are the run's own objects (a change to
    one, e.g. a test's ``trainer.cfg.trainer.micro_batch_size = 1``, is seen by both).

    Reads: the ``trainer``, ``model``, ``teacher``, ``critic``, ``checkpoint``, ``memory``, ``sft``,
    ``grpo`` and ``rollout`` sections (``rollout``: a teacher served by the engine, the engine kind's
    adapter hand-off), ``max_steps`` (the RL schedule's length), ``seed``; ``objective``: the
    :class:`~megaforge.algorithms.params.ObjectiveParams` (``algo.*``, ``grpo.*``, ``teacher.*``)."""

    trainer: Any
    model: Any
    teacher: Any
    critic: Any
    checkpoint: Any
    memory: Any
    sft: Any
    grpo: Any
    rollout: Any
    objective: "ObjectiveParams"
    max_steps: int = 0
    seed: int = 0

    _missing = ("a trainer receives a TrainerSpec (fields: {fields}), not the whole configuration "
                "(megaforge.build.RunBuilder.trainer_spec)")
