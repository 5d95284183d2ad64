"""The objective's parameters: one frozen object that advantages, losses, KL terms and aggregations read.

:class:`ObjectiveParams` is built once from the config (:meth:`ObjectiveParams.from_sections`, which
:meth:`megaforge.build.RunBuilder.objective` calls). It
declares none of its keys: its fields are copied (name, type, default, range) from the config sections
that declare them (:data:`SOURCES`): every key of the ``algo:`` section's own but those the loop reads
(:data:`LOOP_KEYS`), ``grpo.clip_low`` / ``clip_high`` / ``beta``, and ``teacher.kl_coef`` /
``task_coef`` / ``task_advantage`` as ``distill_<key>``; their docstrings in
:mod:`megaforge.config.objective` and :mod:`megaforge.config.teacher` say what each means. A new key of
the objective is a field of :class:`~megaforge.config.objective.AlgoKeys` and nothing else (a new
``algo.`` key that only the loop reads is also named in :data:`LOOP_KEYS`).

A registry entry may declare its own typed parameters, a frozen dataclass with a docstring per field::

    @dataclass(frozen=True)
    class SapoParams:
        tau_pos: float = 1.0
        # a docstring per field: what --help prints

    @POLICY_LOSSES.register("sapo", params=SapoParams)
    def sapo_loss(logprobs, old_logprobs, advantages, mask, p):
        tau = p.of(SapoParams).tau_pos

Field ``tau_pos`` of entry ``sapo`` is config key ``algo.sapo_tau_pos`` (``algo.<entry>_<field>``),
type-checked, listed by ``--help`` and suggested on a typo like every other key; the dataclass's
``validate()`` may raise :class:`~megaforge.configtree.FieldError` about a field, and the error names
the key. A plug-in's keys exist when the module defining its dataclass is in ``algo.plugins``: the
config imports those modules before it reads the keys.
"""
from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megaforge import configtree
from megaforge.algorithms.core import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES
from megaforge.config.objective import AlgoKeys, GRPOConfig
from megaforge.config.teacher import TeacherConfig
from megaforge.configtree import ConfigError

#: the registries whose entries' parameters are config keys of the ``algo`` section
REGISTRIES = (ADVANTAGES, POLICY_LOSSES, LOSS_AGGS, KL_ESTIMATORS)
DEFAULT_LOSS_AGG = "token_mean"
#: keys of the ``algo:`` section that the loop reads, not the objective (dynamic sampling, overlong
#: shaping) and the plug-in modules imported at start-up: no fields of ObjectiveParams
LOOP_KEYS = ("dynamic_sampling", "dynamic_sampling_max_rounds", "overlong_buffer", "overlong_penalty", "plugins")
#: where ObjectiveParams's fields are declared: (section, its dataclass, {key: field name}), in field order
SOURCES = (
    ("algo", AlgoKeys, {f.name: f.name for f in dataclasses.fields(AlgoKeys) if f.name not in LOOP_KEYS}),
    ("grpo", GRPOConfig, {k: k for k in ("clip_low", "clip_high", "beta")}),
    ("teacher", TeacherConfig, {k: "distill_" + k for k in ("kl_coef", "task_coef", "task_advantage")}),
)


def _defined_in(cls: type, modules) -> bool:
    m = cls.__module__
    return any(m == p or m.startswith(p + ".") for p in ("megaforge", *modules))


def component_classes(plugins: Optional[list[str]] = None) -> dict[str, type]:
    """{key prefix ``<entry>_``: parameters dataclass} of the registered entries that declare some:
    all of them, or with ``plugins`` (``algo.plugins``) those whose dataclass is megaforge's or defined
    in one of these modules, so that a config's keys depend on the config alone (not on what else
    this process imported). ValueError when two entries' keys collide or one class serves two."""
    out: dict[str, type] = {}
    owner: dict[str, str] = {}
    for reg in REGISTRIES:
        for name, cls in reg.params_classes().items():
            if plugins is not None and not _defined_in(cls, plugins):
                continue
            if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
                raise ValueError(f"{reg.kind} {name!r}: params={cls!r} must be a frozen dataclass")
            if cls in out.values():
                raise ValueError(f"{reg.kind} {name!r}: params {cls.__name__} already serves another entry")
            for f in dataclasses.fields(cls):
                key = f"{name}_{f.name}"
                if key in owner:
                    raise ValueError(f"config key 'algo.{key}' is declared by {owner[key]} and by {reg.kind} {name!r}")
                owner[key] = f"{reg.kind} {name!r}"
            out[f"{name}_"] = cls
    return out


def default_components() -> dict[type, Any]:
    """{parameters dataclass: its defaults} of every registered entry."""
    return {cls: cls() for cls in component_classes().values()}


def _copy_config_fields(cls: type) -> type:
    """Give ``cls`` (before ``@dataclass``) a field per key of :data:`SOURCES`, ahead of its own: the
    config field's type, default and range, and ``metadata["key"]``, the dotted config key."""
    copied: dict[str, Any] = {}
    for section, source, names in SOURCES:
        hints = typing.get_type_hints(source)
        for f in dataclasses.fields(source):
            if f.name not in names:
                continue
            default = ({"default": f.default} if f.default is not dataclasses.MISSING
                       else {"default_factory": f.default_factory})
            copied[names[f.name]] = hints[f.name]
            setattr(cls, names[f.name], field(**default, metadata={**f.metadata, "key": f"{section}.{f.name}"}))
    if set(copied) & set(cls.__dict__.get("__annotations__", {})):
        raise TypeError(f"{cls.__name__} declares a field the config declares: "
                        f"{sorted(set(copied) & set(cls.__annotations__))}")
    cls.__annotations__ = {**copied, **cls.__dict__.get("__annotations__", {})}
    return cls


@dataclass(frozen=True)
@_copy_config_fields
class ObjectiveParams:
    """What every advantage estimator, policy loss, KL term and aggregation reads (frozen).

    Fields copied from the config (:data:`SOURCES`), named like its keys (``p.tis_cap`` is
    ``algo.tis_cap``, ``p.clip_low`` ``grpo.clip_low``, ``p.distill_kl_coef`` ``teacher.kl_coef``),
    with the config's types, defaults and ranges. Two are resolved: ``loss_agg`` null becomes the
    loss's own aggregation on construction (the registry entry's declared one, else token_mean; so
    ``p.loss_agg`` is never null), and :meth:`from_sections` also refuses an explicit one that contradicts
    the loss's (:func:`resolve_loss_agg`) and turns ``loss_agg_norm`` 0 into ``rollout.max_new_tokens``."""

    components: dict = field(default_factory=default_components)
    """{parameters dataclass: value} of every registered entry that declares parameters."""

    def __post_init__(self):
        if self.loss_agg is None:  # the loss's own, as the config's null means
            object.__setattr__(self, "loss_agg", POLICY_LOSSES.declared(self.loss).get("loss_agg") or DEFAULT_LOSS_AGG)

    def of(self, cls: type):
        """The configured parameters of the entry that declared dataclass ``cls``."""
        if cls not in self.components:
            raise KeyError(f"no parameters {cls.__name__} in this objective (it has: "
                           f"{', '.join(sorted(c.__name__ for c in self.components)) or 'none'}): register the entry "
                           f"with params={cls.__name__} and put {cls.__module__} in algo.plugins")
        return self.components[cls]

    @classmethod
    def from_sections(cls, algo, grpo, teacher, max_new_tokens: int) -> "ObjectiveParams":
        """Read the ``algo``, ``grpo`` and ``teacher`` sections (:data:`SOURCES`) and
        ``rollout.max_new_tokens`` (the default ``loss_agg_norm``); imports ``algo.plugins`` and checks
        that every named component exists, so a typo fails at start-up with the config key and the
        registered names."""
        a = algo
        resolve_components(a)
        sections = {"algo": algo, "grpo": grpo, "teacher": teacher}
        values = {name: getattr(sections[section], key)
                  for section, _, names in SOURCES for key, name in names.items()}
        values.update(loss_agg=resolve_loss_agg(a), loss_agg_norm=a.loss_agg_norm or float(max_new_tokens),
                      plugin_kwargs=dict(a.plugin_kwargs))
        return cls(**values, components={type(v): v for v in a.components.values()})

    @classmethod
    def of_values(cls, **values) -> "ObjectiveParams":
        """From flat values named like the config keys (``clip_low=0.2``, ``sapo_tau_pos=1.0``), the rest
        at their defaults, each type- and range-checked as in the config. For code that calls a loss or
        an estimator directly (tests, tools); a run uses :meth:`from_sections`."""
        classes = component_classes()
        flat = {p + f.name: (p, f.name) for p, c in classes.items() for f in dataclasses.fields(c)}
        own = {f.name for f in dataclasses.fields(cls)} - {"components"}
        parts: dict[str, dict] = {p: {} for p in classes}
        for key in set(values) - own:
            if key not in flat:
                raise ConfigError(f"unknown objective parameter {key!r}; valid: {', '.join(sorted(own | set(flat)))}")
            prefix, name = flat[key]
            parts[prefix][name] = values.pop(key)
        hints = typing.get_type_hints(cls)
        obj = cls(**{k: configtree.coerce(v, hints[k], k) for k, v in values.items()},
                  components={c: configtree.build(c, parts[p], p) for p, c in classes.items()})
        configtree.check_bounds(obj)
        return obj


def load_plugins(modules) -> None:
    """Import each module of ``algo.plugins`` (their import registers losses, advantages, rewards)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"config key 'algo.plugins': cannot import module {name!r}: {e}") from e
        except Exception as e:  # the module itself failed at import: one line naming it and the error
            raise ConfigError(f"config key 'algo.plugins': importing module {name!r} failed: "
                              f"{type(e).__name__}: {e}") from e


def resolve_components(a) -> None:
    """Import ``algo.plugins``, then look up every configured algorithm component (``a``: the ``algo``
    section); an unknown name raises ConfigError (a ValueError) naming the config key and listing the
    registered names."""
    load_plugins(a.plugins)
    for key, reg in (("algo.advantage", ADVANTAGES), ("algo.loss", POLICY_LOSSES),
                     ("algo.loss_agg", LOSS_AGGS), ("algo.kl_estimator", KL_ESTIMATORS)):
        name = getattr(a, key.split(".")[1])
        if name is None:  # algo.loss_agg null: the loss's own (resolve_loss_agg)
            continue
        try:
            reg.get(name)
        except ValueError as e:
            raise ConfigError(f"config key '{key}': {e}") from e
    resolve_loss_agg(a)


def resolve_loss_agg(algo) -> str:
    """The aggregation of ``algo.loss``: ``algo.loss_agg`` when set, else the one the loss's registry
    entry declares (its paper's objective), else token_mean. An explicit ``algo.loss_agg`` that
    contradicts the declared one raises ConfigError naming both keys: under another aggregation the
    loss is not its paper's objective (register the function under another name to run a variant)."""
    declared = POLICY_LOSSES.declared(algo.loss).get("loss_agg")
    if algo.loss_agg is None:
        return declared or DEFAULT_LOSS_AGG
    if declared is not None and algo.loss_agg != declared:
        raise ConfigError(f"config key 'algo.loss_agg': {algo.loss_agg!r} contradicts algo.loss {algo.loss!r}, "
                          f"whose paper's objective aggregates {declared!r}; set algo.loss_agg to {declared!r} "
                          f"or null (the loss's own)")
    return algo.loss_agg
