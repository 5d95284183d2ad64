import os
import re

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
    with pytest.raises(ConfigError, match=r"'trainer.learning_rate': \(TRL's key\) use trainer\.lr "):  # aliases
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


def test_on_off_words_of_a_choice(tmp_path):
    """YAML 1.1 reads a bare on / off as a boolean: a choice that has the words gets them back (the
    command line and a YAML file alike); a boolean for a choice without them is still an error."""
    cfg = load_config(["--config", DEMO, "--rollout.fast", "off", "--rollout.fast_compile", "off"])
    assert (cfg.rollout.fast, cfg.rollout.fast_compile) == ("off", "off")
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  fast: on\n  fast_compile: off\ntrainer:\n  autocast: off\n")
    cfg = load_config(["--config", str(p), "--model.config", "x", "--data.path", "arithmetic"])
    assert (cfg.rollout.fast, cfg.rollout.fast_compile, cfg.trainer.autocast) == ("on", "off", "off")
    with pytest.raises(ConfigError, match="config key 'rollout.fast_compile'.*got True"):
        load_config(["--config", DEMO, "--rollout.fast_compile", "on"])  # no "on" among its choices
    with pytest.raises(ConfigError, match="config key 'trainer.backend'.*got False"):
        load_config(["--config", DEMO, "--trainer.backend", "off"])
    save_config(cfg, str(tmp_path / "r.yaml"))
    assert load_config(["--config", str(tmp_path / "r.yaml")]) == cfg  # saved quoted, read back as words


def test_semantic_validation_names_key():
    with pytest.raises(ConfigError, match="grpo.temperature"):
        load_config(["--config", DEMO, "--grpo.temperature", "0"])
    with pytest.raises(ConfigError, match="trainer.sequence_parallel"):
        load_config(["--config", DEMO, "--trainer.sequence_parallel", "true"])
    with pytest.raises(ConfigError, match="config key 'sync.transport': 'ipc' is for engines in other processes"):
        load_config(["--config", DEMO, "--sync.transport", "ipc"])  # DEMO's engine is embedded: ipc would be unused
    assert load_config(["--config", DEMO, "--sync.transport", "inproc"]).sync.transport == "inproc"
    with pytest.raises(ConfigError, match="config key 'sync.transport': 'inproc' needs rollout.engine: embedded"):
        load_config(["--config", DEMO, "--rollout.engine", "embedded_server", "--sync.transport", "inproc"])


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


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_non_finite_floats_are_config_errors(tmp_path, value):
    """trainer.lr .inf used to run (and write 51 non-finite tensors into the checkpoint)."""
    with pytest.raises(ConfigError, match=r"config key 'trainer.lr': expected a finite number"):
        load_config(["--config", DEMO, "--trainer.lr", value])
    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{config: x}}\ndata: {{path: arithmetic}}\nrewards: {{timeout_s: {value}}}\n")
    with pytest.raises(ConfigError, match=r"config key 'rewards.timeout_s': expected a finite number"):
        load_config(["--config", str(p)])


BOMB = """model: {config: x}
data:
  path: arithmetic
  synthetic_kwargs:
    a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_yaml_alias_bomb_is_refused_before_save_config(tmp_path):
    """9^9 values behind aliases in a dict-typed key: save_config (the run directory's config.yaml)
    used to expand them and hang. Run in a subprocess so that a hang fails instead of blocking."""
    import subprocess
    import sys

    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    code = ("import sys; from megaforge.config import load_config, save_config; from megaforge.configtree import ConfigError\n"
            "try:\n    save_config(load_config(['--config', sys.argv[1]]), sys.argv[2])\n    print('SAVED')\n"
            "except ConfigError as e:\n    print('REFUSED', e)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, str(p), str(tmp_path / "out.yaml")], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=root))
    assert out.stdout.startswith(f"REFUSED --config {p}: the YAML expands to more than 100000 values"), out.stdout + out.stderr
    assert not (tmp_path / "out.yaml").exists()


def test_recursive_yaml_alias_is_refused_and_normal_aliases_work(tmp_path):
    p = tmp_path / "loop.yaml"
    p.write_text("model: {config: x}\ndata: {path: arithmetic, synthetic_kwargs: {a: &a [1, *a]}}\n")
    with pytest.raises(ConfigError, match=r"a YAML alias refers to a value that contains it"):
        load_config(["--config", str(p)])
    p.write_text("model: {config: x}\ndata: {path: arithmetic}\ntrainer: {lr: &lr 2.0e-5}\nsft: {lr: *lr}\n")
    cfg = load_config(["--config", str(p)])
    assert cfg.trainer.lr == cfg.sft.lr == pytest.approx(2e-5)


@pytest.mark.parametrize("key,value,expect", [
    ("sft.lr", "-3e-3", "must be >= 0, got -0.003"),
    ("trainer.lr", "-1e-6", "must be >= 0"),
    ("trainer.min_lr", "-1", "must be >= 0"),
    ("critic.lr", "0", "must be > 0"),
    ("trainer.grad_clip", "-1", "must be >= 0"),
    ("trainer.eps", "0", "must be > 0"),
    ("trainer.weight_decay", "-0.1", "must be >= 0"),
    ("trainer.warmup_steps", "-5", "must be >= 0"),
    ("sft.warmup_steps", "-5", "must be >= 0"),
    ("grpo.clip_low", "1.5", "must be in [0, 1)"),
    ("grpo.clip_high", "-0.2", "must be >= 0"),
    ("grpo.temperature", "-1", "must be > 0"),
    ("eval.temperature", "-1", "must be > 0 (or null)"),
    ("algo.clip_c", "1", "must be > 1 (or null)"),
    ("algo.gamma", "0", "must be in (0, 1]"),
    ("rollout.top_p", "0", "must be in (0, 1]"),
])
def test_impossible_values_are_refused_at_load(key, value, expect):
    """`--sft.lr -3e-3` used to run (gradient ascent, exit 0): every lr / clip / temperature-like key
    declares its range next to its field (configtree.bounded) and a value outside it is refused."""
    with pytest.raises(ConfigError, match="^" + re.escape(f"config key '{key}': {expect}")):
        load_config(["--config", DEMO, f"--{key}", value])


def test_list_elements_and_null_against_bounds():
    with pytest.raises(ConfigError, match=r"^config key 'trainer.betas\[1\]': must be in \[0, 1\), got 1.0$"):
        load_config(["--config", DEMO, "--trainer.betas", "[0.9, 1.0]"])
    cfg = load_config(["--config", DEMO, "--sft.lr", "0", "--algo.clip_c", "null", "--critic.value_clip", "null"])
    assert (cfg.sft.lr, cfg.algo.clip_c, cfg.critic.value_clip) == (0.0, None, None)


def test_a_bound_declared_on_any_dataclass_names_its_dotted_key():
    from dataclasses import dataclass, field

    from megaforge.configtree import bounded, build, help_text

    @dataclass
    class Inner:
        rate: float = bounded(0.5, gt=0, le=1)
        """A rate."""

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=Inner)
        """Inner."""

    assert build(Outer, {"inner": {"rate": 1}}).inner.rate == 1.0
    with pytest.raises(ConfigError, match=r"^config key 'inner.rate': must be in \(0, 1\], got 0.0$"):
        build(Outer, {"inner": {"rate": 0}})
    assert "inner.rate (float, default 0.5, in (0, 1]): A rate." in help_text(Outer)


def test_the_launcher_refuses_a_negative_lr_in_one_line():
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from run_helpers import run_in_process

    rc, out, err = run_in_process("sft", ["--config", DEMO, "--sft.lr", "-3e-3", "--output_dir", "/nonexistent/x"])
    assert rc == 2 and err == "megaforge: config error: config key 'sft.lr': must be >= 0, got -0.003\n", err


def test_server_flags_reads_extra_args_one_way():
    """rollout.extra_args' one reader: ``--flag v ...``, ``--flag=v``, a bare flag; a stray value is an error
    naming the key (the planner and the peers' mapping both read through it)."""
    from megaforge.config.rollout import server_flags
    assert server_flags(["--attention-backend", "fa3", "--cuda-graph-bs-decode", "1", "2", "--disable-radix-cache",
                         "--kv-cache-dtype=fp8_e5m2"]) == {
        "--attention-backend": ["fa3"], "--cuda-graph-bs-decode": ["1", "2"], "--disable-radix-cache": [],
        "--kv-cache-dtype": ["fp8_e5m2"]}
    assert server_flags([]) == {}
    with pytest.raises(ValueError, match=r"rollout.extra_args: value 'triton' comes before any --flag"):
        server_flags(["triton", "--attention-backend"])
    with pytest.raises(ConfigError, match=r"config key 'rollout.extra_args': value '512' comes before any --flag"):
        load_config(["--config", "configs/demo_cpu.yaml", "--rollout.extra_args", "['512',--cuda-graph-max-bs]"])
