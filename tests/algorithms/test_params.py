"""ObjectiveParams declares no key of its own: each of its fields is a config key (``algo.*``,
``grpo.clip_low`` / ``clip_high`` / ``beta``, ``teacher.*`` as ``distill_*``) with the config's type,
default and range, and :meth:`ObjectiveParams.from_sections` (through
:meth:`megaforge.build.RunBuilder.objective`) reads each from its section."""
import dataclasses
import typing

import pytest
from algo_helpers import ROOT

from megaforge.algorithms import ObjectiveParams
from megaforge.algorithms.params import LOOP_KEYS
from megaforge.build import RunBuilder
from megaforge.config import Config
from megaforge.configtree import ConfigError

OWN = ("components",)  # ObjectiveParams's own field: the typed parameters by dataclass (not a key)


def _objective_fields():
    return [f for f in dataclasses.fields(ObjectiveParams) if f.name not in OWN]


def _config_field(key: str):
    """(section dataclass, field) of dotted config key ``key``, looked up from the root Config."""
    section, name = key.split(".")
    cls = typing.get_type_hints(Config)[section]
    return cls, next(f for f in dataclasses.fields(cls) if f.name == name)


def _default(f):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_every_field_is_a_config_key_with_its_type_default_and_range():
    hints = typing.get_type_hints(ObjectiveParams)
    for f in _objective_fields():
        key = f.metadata["key"]
        cls, cf = _config_field(key)
        assert f.name == (cf.name if not key.startswith("teacher.") else "distill_" + cf.name), key
        assert hints[f.name] == typing.get_type_hints(cls)[cf.name], key
        assert _default(f) == _default(cf), key
        assert f.metadata.get("bound") is cf.metadata.get("bound"), key


def test_every_key_of_the_algo_section_but_the_loops_is_a_field():
    # a new algo.* key is a field without another declaration; the loop's keys and algo.plugins are not
    algo = typing.get_type_hints(Config)["algo"]
    own = {f.name for f in dataclasses.fields(algo) if "extensions" not in f.metadata}
    fields = {f.metadata["key"] for f in _objective_fields()}
    assert {f"algo.{k}" for k in own - set(LOOP_KEYS)} == {k for k in fields if k.startswith("algo.")}
    assert set(LOOP_KEYS) <= own
    assert {k for k in fields if not k.startswith("algo.")} == {"grpo.clip_low", "grpo.clip_high", "grpo.beta",
                                                              "teacher.kl_coef", "teacher.task_coef",
                                                              "teacher.task_advantage"}


# a value other than the default for each key (keys added later are compared at their defaults)
VALUES = {"algo.advantage": "reinforce_pp", "algo.loss": "cispo", "algo.loss_agg": "seq_mean_token_sum",
          "algo.loss_agg_norm": 7.0, "algo.kl_estimator": "k2", "algo.kl_in_reward": True, "algo.entropy_coef": 0.01,
          "algo.clip_c": 3.0, "algo.std_eps": 1e-5, "algo.tis_cap": 2.0, "algo.tis_level": "sequence",
          "algo.mis_threshold": 4.0, "algo.mis_threshold_low": 0.25, "algo.mis_level": "geometric", "algo.gamma": 0.9,
          "algo.lam": 0.95, "algo.plugin_kwargs": {"width": 2}, "grpo.clip_low": 0.1, "grpo.clip_high": 0.3,
          "grpo.beta": 0.02, "teacher.kl_coef": 0.5, "teacher.task_coef": 0.25, "teacher.task_advantage": "dr_grpo"}


def _config(values: dict):
    from megaforge.config import config_from_dict

    tree: dict = {"model": {"path": f"{ROOT}/model"}, "data": {"path": f"{ROOT}/data.jsonl"}}
    for key, v in values.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = v
    return config_from_dict(tree)


def test_from_config_reads_each_field_from_its_key():
    cfg = _config(VALUES)
    p = RunBuilder(cfg).objective()
    for f in _objective_fields():
        key = f.metadata["key"]
        section, name = key.split(".")
        if key in VALUES:
            assert VALUES[key] != _default(_config_field(key)[1]), key  # the value tells the key was read
        assert getattr(p, f.name) == getattr(getattr(cfg, section), name), key


def test_the_resolved_fields():
    # algo.loss_agg null: the loss's own (gspo's paper aggregates seq_mean_token_mean), at every construction;
    # algo.loss_agg_norm 0: rollout.max_new_tokens
    p = RunBuilder(_config({"algo.loss": "gspo", "rollout.max_new_tokens": 24})).objective()
    assert (p.loss_agg, p.loss_agg_norm) == ("seq_mean_token_mean", 24.0)
    assert ObjectiveParams(loss="gspo").loss_agg == "seq_mean_token_mean"
    assert ObjectiveParams().loss_agg == "token_mean"
    assert ObjectiveParams(loss="gspo", loss_agg="token_mean").loss_agg == "token_mean"  # set: kept


@pytest.mark.parametrize("values,error", [
    ({"tis_level": "seq"}, r"'tis_level': expected one of 'token', 'sequence', got 'seq'"),
    ({"clip_low": 1.5}, r"'clip_low': must be in \[0, 1\), got 1.5"),
    ({"distill_task_advantage": "gae"}, r"'distill_task_advantage': expected one of"),
    ({"sapo_tau_pos": "warm"}, r"'sapo_tau_pos': expected float"),
])
def test_of_values_checks_types_and_ranges_as_the_config(values, error):
    with pytest.raises(ConfigError, match=error):
        ObjectiveParams.of_values(**values)
