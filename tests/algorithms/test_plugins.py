"""Plug-ins: losses / advantages / rewards by registered name or ``package.module:callable``; an
unknown name lists the registered ones and names the config key."""
import math
import textwrap

import pytest
import torch
from algo_helpers import ROOT, SMOKE, lp_for_ratio, params, read_metrics, run_launcher

from megaforge.algorithms import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, POLICY_LOSSES, resolve_components
from megaforge.configtree import ConfigError


def test_unknown_name_lists_the_registered_ones():
    for reg, expect in ((POLICY_LOSSES, ["cispo", "gspo", "ppo_clip", "reinforce", "sapo"]),
                        (ADVANTAGES, ["dr_grpo", "gae", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]),
                        (LOSS_AGGS, ["seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_mean"]),
                        (KL_ESTIMATORS, ["k1", "k2", "k3", "low_var_kl"])):
        with pytest.raises(ValueError) as e:
            reg.get("no_such_thing")
        assert "'no_such_thing'" in str(e.value)
        for name in expect:
            assert name in str(e.value), (name, str(e.value))


def _cfg(*argv):
    from megaforge.config import load_config

    return load_config(["--config", f"{ROOT}/configs/demo_cpu.yaml", *argv])


@pytest.mark.parametrize("key,value", [("algo.loss", "ppo_clp"), ("algo.advantage", "grpoo"),
                                       ("algo.loss_agg", "mean"), ("algo.kl_estimator", "k4"),
                                       ("algo.loss", "no_such_module_xyz:fn"), ("algo.plugins", "[no_such_module_xyz]")])
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        resolve_components(_cfg(f"--{key}", value).algo)


def test_seed_custom_loss_by_path_and_by_name():
    fn = POLICY_LOSSES.get("examples.custom_loss.seed_loss:custom_loss")
    old = torch.tensor([[math.log(0.3), math.log(0.6)]], dtype=torch.float64)
    lp = lp_for_ratio([[1.5, 0.5]], old)
    A = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, st = fn(lp, old, A, torch.ones_like(A), params(seed_custom_clip_range=0.2))
    assert torch.allclose(loss, torch.tensor([[-1.2, 0.8]], dtype=torch.float64))
    assert st["clip_frac"].tolist() == [[1.0, 1.0]]
    resolve_components(_cfg("--algo.plugins", "[examples.custom_loss.seed_loss]", "--algo.loss", "seed_custom").algo)
    assert POLICY_LOSSES.get("seed_custom") is fn


def test_custom_advantage_and_reward_in_a_run(tmp_path, in_root, monkeypatch):
    (tmp_path / "my_plugins.py").write_text(textwrap.dedent('''
        import torch
        from megaforge.algorithms import ADVANTAGES

        CALLS = []

        @ADVANTAGES.register("sign_of_reward")
        def sign_of_reward(inp, cfg):
            CALLS.append(inp.rewards.clone())
            scale = cfg.plugin_kwargs["scale"]
            return torch.sign(inp.rewards - inp.rewards.mean())[:, None] * inp.loss_mask * scale

        def length_reward(prompt, response, target, per_char=0.01):
            return per_char * len(response)

        from megaforge.rewards import REWARDS

        REWARDS.register("always_one", lambda prompt, response, target: 1.0)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = run_launcher("grpo", ["--config", "configs/demo_cpu.yaml", *SMOKE, "--algo.plugins", "[my_plugins]",
                                "--algo.advantage", "sign_of_reward", "--algo.plugin_kwargs", "{scale: 2.0}",
                                "--rewards.functions", "[{name: 'my_plugins:length_reward', kwargs: {per_char: 0.5}}, "
                                "{name: always_one, weight: 0.25}]"],
                       str(tmp_path), "plug")
    import my_plugins

    assert len(my_plugins.CALLS) == 2  # one advantage call per RL step
    recs = read_metrics(run)
    assert len(recs) == 2 and recs[0]["reward/length_reward"] > 0
    assert recs[0]["reward/always_one"] == 1.0  # registered by name in an algo.plugins module
    assert recs[0]["reward/mean"] == pytest.approx(recs[0]["reward/length_reward"] + 0.25)


def test_a_plugin_advantage_with_typed_params_runs_a_step(tmp_path, in_root, monkeypatch):
    """An advantage registered with params= reads its typed key (algo.scaled_sign_scale) through
    ``p.of(...)`` at the run's step (before: the estimator got cfg.algo, an AlgoConfig without .of(),
    and the run died at step 1 with AttributeError) and sees the grpo.* values ObjectiveParams carries."""
    (tmp_path / "typed_adv.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        import torch
        from megaforge.algorithms import ADVANTAGES

        SEEN = []

        @dataclass(frozen=True)
        class ScaledSignParams:
            scale: float = 1.0
            """Advantage magnitude."""

        @ADVANTAGES.register("scaled_sign", params=ScaledSignParams)
        def scaled_sign(inp, p):
            SEEN.append((p.of(ScaledSignParams).scale, p.clip_low))
            return torch.sign(inp.rewards - inp.rewards.mean())[:, None] * inp.loss_mask * p.of(ScaledSignParams).scale
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = run_launcher("grpo", ["--config", "configs/demo_cpu.yaml", *SMOKE, "--algo.plugins", "[typed_adv]",
                                "--algo.advantage", "scaled_sign", "--algo.scaled_sign_scale", "3.0",
                                "--grpo.clip_low", "0.15"], str(tmp_path), "typed")
    import typed_adv

    assert typed_adv.SEEN == [(3.0, 0.15)] * 2  # one call per RL step, the typed key and grpo.clip_low read
    assert len(read_metrics(run)) == 2


@pytest.mark.parametrize("argv,key", [
    (["--algo.kl_in_reward", "true"], "algo.kl_in_reward"),  # demo: grpo with beta 0.01
    (["--algo.advantage", "gae", "--critic.enabled", "false"], "critic.enabled"),
    (["--algo.mis_threshold_low", "0.5"], "algo.mis_threshold_low"),
    (["--algo.mis_threshold", "2", "--algo.mis_threshold_low", "3"], "algo.mis_threshold_low"),
    (["--algo.overlong_buffer", "24"], "algo.overlong_buffer"),
    (["--algo.sapo_tau_neg", "0"], "algo.sapo_tau_neg"),
    (["--algo.mis_level", "seq"], "algo.mis_level"),
    (["--loop.oversample", "0.5"], "loop.oversample"),
    (["--critic.value_clip", "-1"], "critic.value_clip"),
])
def test_algorithm_config_validation_names_the_key(argv, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(*argv)


def test_a_plugin_loss_knob_is_a_typed_config_key(in_root):
    """examples/custom_loss: torchforge's loss declares params=SeedCustomParams; its field is the key
    algo.seed_custom_clip_range, read from the YAML, checked, suggested on a typo."""
    from examples.custom_loss.seed_loss import SeedCustomParams

    from megaforge.build import RunBuilder
    from megaforge.config import load_config

    yaml_cfg = ["--config", "examples/custom_loss/seed_loss.yaml"]
    assert RunBuilder(load_config(yaml_cfg)).objective().of(SeedCustomParams).clip_range == 0.2
    p = RunBuilder(load_config([*yaml_cfg, "--algo.seed_custom_clip_range", "0.1"])).objective()
    old = torch.tensor([[math.log(0.3), math.log(0.6)]], dtype=torch.float64)
    loss, _ = POLICY_LOSSES.get(p.loss)(lp_for_ratio([[1.5, 0.5]], old), old, torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                                        torch.ones(1, 2, dtype=torch.float64), p)
    # ratios 1.5 and 0.5 clipped to 1.1 and 0.9; float64, two operations: 1e-12
    assert torch.allclose(loss, torch.tensor([[-1.1, 0.9]], dtype=torch.float64), atol=1e-12)
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.seed_custom_clip_rang'; did you mean "
                                          r"'algo.seed_custom_clip_range'"):
        load_config([*yaml_cfg, "--algo.seed_custom_clip_rang", "0.1"])
    with pytest.raises(ConfigError, match=r"config key 'algo.seed_custom_clip_range': must be in \(0, 1\)"):
        load_config([*yaml_cfg, "--algo.seed_custom_clip_range", "1.5"])
    with pytest.raises(ConfigError, match=r"config key 'algo.seed_custom_clip_range': expected float"):
        load_config([*yaml_cfg, "--algo.seed_custom_clip_range", "wide"])
    # the key exists only where the config names the plug-in, whatever this process imported before
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.seed_custom_clip_range'"):
        _cfg("--algo.seed_custom_clip_range", "0.1")
