import os

import pytest
import yaml

from megaforge.config import Config, load_config, save_config
from megaforge.configtree import ConfigError

DEMO = os.path.join(os.path.dirname(__file__), "..", "configs", "demo_cpu.yaml")


def test_yaml_plus_dotted_overrides():
    cfg = load_config(["--config", DEMO, "--grpo.n_samples", "4", "--output_dir", "/tmp/x", "--trainer.lr=2e-5",
                       "--rollout.stop", "[a, b]", "--resume"])
    assert cfg.grpo.n_samples == 4 and cfg.output_dir == "/tmp/x"
    assert cfg.trainer.lr == pytest.approx(2e-5) and isinstance(cfg.trainer.lr, float)
    assert cfg.rollout.stop == ["a", "b"] and cfg.resume is True
    assert cfg.run_dir == os.path.join("/tmp/x", "demo_cpu")
    assert cfg.model.tokenizer == "assets/tiny-tokenizer"  # from the YAML


def test_unknown_key_names_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.n_sample'; did you mean 'grpo.n_samples'"):
        load_config(["--config", DEMO, "--grpo.n_sample", "4"])
    with pytest.raises(ConfigError, match=r"'trainer.learning_rate'.*'trainer\.\w+'"):
        load_config(["--config", DEMO, "--trainer.learning_rate", "1"])


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"model": {"config": "x"}, "data": {"path": "arithmetic"}, "grpo": {"temprature": 1.0}}))
    with pytest.raises(ConfigError, match=r"'grpo.temprature'; did you mean 'grpo.temperature'"):
        load_config(["--config", str(p)])


@pytest.mark.parametrize("key,value,expect", [
    ("grpo.n_samples", "four", "expected int"),
    ("metrics.wandb", "3", "expected bool"),
    ("trainer.backend", "jax", "one of 'torch', 'megatron'"),
    ("rollout.stop", "5", "expected list of str"),
])
def test_wrong_type_names_key(key, value, expect):
    with pytest.raises(ConfigError, match=f"config key '{key}'.*{expect}"):
        load_config(["--config", DEMO, f"--{key}", value])


def test_semantic_validation_names_key():
    with pytest.raises(ConfigError, match="grpo.temperature"):
        load_config(["--config", DEMO, "--grpo.temperature", "0"])
    with pytest.raises(ConfigError, match="trainer.sequence_parallel"):
        load_config(["--config", DEMO, "--trainer.sequence_parallel", "true"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(["--config", DEMO, "--grpo.beta", "0.5"])
    save_config(cfg, str(tmp_path / "c.yaml"))
    again = load_config(["--config", str(tmp_path / "c.yaml")])
    assert again == cfg


def test_help_lists_keys_with_docs(capsys):
    with pytest.raises(SystemExit):
        load_config(["--help"])
    out = capsys.readouterr().out
    assert "grpo.n_samples (int, default 8): Responses sampled per prompt" in out
    assert "trainer.tensor_parallel" in out


def test_defaults_are_valid_types():
    # every default of the tree passes its own type check
    from megaforge.configtree import build, to_dict

    d = to_dict(Config(model=Config().model))
    d["model"]["config"] = "x"
    d["data"]["path"] = "arithmetic"
    build(Config, d)
