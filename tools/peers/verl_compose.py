#!/usr/bin/env python
"""Compose verl 0.9.1's trainer config with the mapped overrides and run verl's own ``validate_config`` on it,
before any GPU time is spent (needs verl, hydra-core, omegaconf, ray and msgpack importable; no GPU).

    python tools/peers/verl_compose.py OVERRIDES.txt [--out composed.yaml]
    python tools/peers/mapping.py verl --config ... | python tools/peers/verl_compose.py - --out composed.yaml

OVERRIDES: one Hydra override a line (tools/peers/mapping.py's output). Prints the values that matter
(batch geometry, clip, lr, lengths, rollout engine and its SGLang arguments) and ``validated``; writes
the composed config (unresolved interpolations resolved) with ``--out``. An override verl does not know,
or a geometry verl refuses, is one ``megaforge: error:`` line naming it.
"""
from __future__ import annotations

import argparse
import os
import sys

SHOW = ["data.train_batch_size", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high",
        "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.optim.weight_decay",
        "data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.model.enable_gradient_checkpointing", "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.engine_kwargs.sglang", "algorithm.adv_estimator", "trainer.total_training_steps"]


def compose(overrides: list[str]):
    """verl's ``ppo_trainer`` config with ``overrides`` (Hydra's compose API, verl's own config folder)."""
    import importlib.util

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not importable")
    cfgdir = os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")
    with initialize_config_dir(config_dir=cfgdir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def validate(cfg) -> None:
    """verl's own checks (verl.trainer.main_ppo runs them first) plus the rollout config's dataclass."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", help="file of overrides, one a line ('-': stdin)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    text = sys.stdin.read() if a.overrides == "-" else open(a.overrides).read()
    overrides = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    try:
        from omegaconf import OmegaConf
        cfg = compose(overrides)
        validate(cfg)
    except ImportError as e:
        print(f"megaforge: error: verl's config cannot be composed here: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - Hydra's and verl's errors, whatever their type: one line naming them
        print(f"megaforge: error: verl refuses the overrides: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    for k in SHOW:
        print(f"{k} = {OmegaConf.select(cfg, k)}")
    if a.out:
        with open(a.out, "w") as f:
            f.write(OmegaConf.to_yaml(cfg))
    print("validated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
