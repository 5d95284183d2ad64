"""megaforge.specs and megaforge.build (issue 42): the build step fills each spec from the config keys its
docstring names; a component given the wrong object (the whole Config, a section) fails at its entry
with a TypeError naming the class expected; a user generate_fn gets a GenerateContext, and reading
what it lacks (``ctx.data``) names its fields."""
import dataclasses
import os
import re

import pytest
import torch

from megaforge import specs
from megaforge.build import RunBuilder
from megaforge.config import load_config
from megaforge.specs import EngineSpec, EvalSettings, GenerateContext, Sampling, Schedule, StepSettings, expect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")


def cfg_of(*argv):
    return load_config(["--config", DEMO, *argv])


def test_expect_passes_the_object_and_names_the_class_expected():
    s = RunBuilder(cfg_of()).sampling()
    assert expect(s, Sampling, "here") is s
    with pytest.raises(TypeError, match=r"here: expected a megaforge\.specs\.StepSettings, got a Sampling"):
        expect(s, StepSettings, "here")


def test_a_component_given_the_whole_config_fails_at_its_entry():
    """The whole Config where a spec is expected: a TypeError naming the spec and the build step, before
    any work (not an AttributeError deep in a step)."""
    from megaforge.driver.steps import StepParts, batch_advantages, start_rl_trainer
    from megaforge.eval.runner import Evaluator
    from megaforge.metrics import MetricsLogger
    from megaforge.rollout.agent.multiturn import call_generate_fn

    cfg = cfg_of()
    for call, cls in [(lambda: StepParts(cfg, None, None, None, None, None, []), "StepSettings"),
                      (lambda: batch_advantages(None, cfg), "StepSettings"),
                      (lambda: start_rl_trainer(None, cfg, False), "Schedule"),
                      (lambda: Evaluator(cfg, [], None, None, []), "EvalSettings"),
                      (lambda: MetricsLogger(cfg, "/nonexistent"), "MetricsConfig"),
                      (lambda: call_generate_fn(cfg, None, [], [], 1, None, 0), "GenerateContext")]:
        with pytest.raises(TypeError, match=rf"expected a [\w.]*\.{cls}, got a Config; the whole configuration is "
                                            rf"read in one place only \(megaforge\.build\.RunBuilder\)"):
            call()


def test_the_builder_fills_each_spec_from_its_keys():
    cfg = cfg_of("--grpo.n_samples", "3", "--grpo.beta", "0.2", "--grpo.temperature", "0.7", "--trainer.epochs", "2",
                 "--rollout.max_new_tokens", "24", "--rollout.top_k", "5", "--seed", "11", "--max_steps", "6",
                 "--sync.bucket_mb", "64", "--loop.oversample", "1.5", "--rewards.stream_prompts", "2",
                 "--eval.interval", "3", "--rollout.generate_fn", "megaforge.rollout.agent.multiturn:tool_rollout",
                 "--rollout.generate_kwargs", "{tools: [calculator]}", "--rollout.max_turns", "2")
    b = RunBuilder(cfg)
    s = b.step_settings()
    from megaforge.algorithms import ObjectiveParams

    assert isinstance(s.objective, ObjectiveParams) and s.objective.beta == 0.2
    assert (s.n_samples, s.beta, s.epochs, s.seed, s.max_steps, s.bucket_mb, s.stream_prompts) == (3, 0.2, 2, 11, 6, 64, 2)
    assert s.loop is cfg.loop and s.loop.oversample == 1.5 and s.updates == cfg.trainer.mini_batches * 2
    assert s.sampling == Sampling(temperature=0.7, top_p=cfg.rollout.top_p, top_k=5, max_new_tokens=24,
                                  stop=tuple(cfg.rollout.stop))
    assert s.needs_ref and s.needs_old_logprobs and not s.is_async
    g = s.generate
    assert (g.generate_fn, g.max_new_tokens, g.max_turns, g.n_samples, g.temperature, g.seed, g.model_path) == (
        "megaforge.rollout.agent.multiturn:tool_rollout", 24, 2, 3, 0.7, 11, cfg.model.path)
    assert g.generate_kwargs == {"tools": ["calculator"]}
    e = b.eval_settings()
    assert e.eval is cfg.eval and e.max_steps == 6 and e.per_step_requests == cfg.rollout.batch_size * 3
    assert b.schedule() == Schedule(lr=cfg.trainer.lr, total_updates=6 * cfg.trainer.mini_batches * 2,
                                    warmup_steps=cfg.trainer.warmup_steps, lr_schedule=cfg.trainer.lr_schedule,
                                    min_lr=cfg.trainer.min_lr)
    assert RunBuilder(cfg_of()).generate_context() is None  # single turn: no context


def test_eval_schedule_reads_its_settings():
    b = RunBuilder(cfg_of("--eval.sets", "[{name: h, holdout: 0.1}]", "--eval.interval", "4", "--max_steps", "10",
                          "--eval.before_train", "true"))
    due = [k for k in range(11) if b.eval_settings().is_due(k)]
    assert due == [0, 4, 8, 10]


def test_each_spec_says_which_config_keys_it_reads():
    for cls in (Sampling, GenerateContext, EngineSpec, StepSettings, EvalSettings, Schedule):
        doc = cls.__doc__ or ""
        assert "Reads:" in doc, cls.__name__
        assert re.findall(r"``[a-z_]+\.[a-z_]+``", doc), cls.__name__  # at least one dotted key named


def test_a_generate_context_names_its_fields_for_what_it_lacks():
    ctx = GenerateContext(max_new_tokens=8)
    with pytest.raises(AttributeError) as e:
        ctx.data
    msg = str(e.value)
    assert "GenerateContext has no attribute 'data'" in msg
    for f in dataclasses.fields(GenerateContext):
        assert f.name in msg
    assert "rollout.generate_kwargs" in msg and "examples/tool_use/README.md" in msg
    assert not hasattr(ctx, "__wrapped__")  # dunder lookups (copy, pickle, inspect) stay plain AttributeErrors
    assert ctx.max_new_tokens == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.max_new_tokens = 9


def old_style_generate_fn(engine, requests, rows, tokenizer, cfg):
    """A generate_fn written against the whole configuration (before issue 42)."""
    return [cfg.data.path] * len(requests)


def test_a_user_generate_fn_reading_the_config_gets_a_clear_error():
    from megaforge.rollout.agent.multiturn import call_generate_fn

    cfg = cfg_of("--rollout.generate_fn", f"{__name__}:old_style_generate_fn")
    with pytest.raises(AttributeError, match=r"GenerateContext has no attribute 'data'.*fields: generate_fn, "
                                             r"max_new_tokens"):
        call_generate_fn(RunBuilder(cfg).generate_context(), None, [object()], [object()], 1, None, 0)


SEEN = []


def probe_advantage(inp, p):
    """A plug-in estimator (``algo.advantage: tests.test_specs:probe_advantage``) recording what it got."""
    SEEN.append(type(p))
    return torch.zeros_like(inp.loss_mask)


def test_an_estimator_receives_the_objective_parameters_not_a_config_section():
    """The bug of issue 42: estimators typed ``p: ObjectiveParams`` once received ``cfg.algo``."""
    from megaforge.algorithms import ObjectiveParams
    from megaforge.driver.steps import batch_advantages
    from megaforge.types import TrainBatch

    SEEN.clear()
    s = RunBuilder(cfg_of("--algo.advantage", f"{__name__}:probe_advantage")).step_settings()
    mask = torch.ones(2, 3)
    batch = TrainBatch(tokens=torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([3, 3]), loss_mask=mask,
                       advantages=torch.zeros(2, 3), rollout_logprobs=torch.zeros(2, 3),
                       rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]))
    assert batch_advantages(batch, s).shape == (2, 3)
    assert SEEN == [ObjectiveParams]


def test_specs_stay_light():
    """megaforge.specs imports no torch (the launcher and the planner read it)."""
    from tests.test_light_imports import loaded_heavy

    assert loaded_heavy("megaforge.specs") == []
    assert specs.__doc__ and "expect" in specs.__doc__


def test_an_engine_kind_gets_the_engine_spec_at_preflight_and_build(tmp_path):
    """A kind's preflight and build receive the EngineSpec the builder makes (the same at both:
    RunBuilder.preflight hands megaforge.rollout.preflight the builder's spec); reading a key it lacks (``spec.sync``) names its fields."""
    from megaforge.engine_kinds import ENGINE_KINDS, EngineKind

    got = []
    if "spec_probe" not in ENGINE_KINDS:
        ENGINE_KINDS.register("spec_probe", EngineKind(build=lambda spec, tok: got.append(("build", spec)),
                                                       in_process=True, max_tp=1,
                                                       preflight=lambda spec: got.append(("preflight", spec))))
    cfg = cfg_of("--rollout.engine", "spec_probe", "--sync.transport", "inproc", "--rollout.dtype", "bfloat16",
                 "--seed", "5", "--output_dir", str(tmp_path))
    RunBuilder(cfg).preflight()
    b = RunBuilder(cfg)
    b.engines(None)
    spec = b.engine_spec()
    assert got == [("preflight", spec), ("build", spec)]
    assert isinstance(spec, EngineSpec) and spec.rollout is cfg.rollout and spec.model is cfg.model
    assert (spec.dtype, spec.seed, spec.run_dir, spec.transport) == ("bfloat16", 5, cfg.run_dir, "inproc")
    with pytest.raises(AttributeError, match=r"EngineSpec has no attribute 'sync'.*fields: rollout, model, dtype"):
        spec.sync
