"""Every config in configs/ loads and runs two steps of the CPU demo; so do the custom-loss example
and every algorithm of the registries, end to end through the loop and the torch trainer.

A config that cannot run here says so in its header, one comment line before any YAML:
``# requires: gpu, megatron, sglang, hub`` (hub: weights or data fetched from the Hugging Face hub).
Such a config is skipped with the unmet requirement as the reason; an unknown requirement fails.
``# launcher: sft`` marks a config of launchers/sft.py (default: launchers/grpo.py).
``# prepare: <key> = <launcher> <flags>`` names a run the config starts from (a LoRA base, a distillation
teacher): the test makes that run first at the smoke size and passes its folder as ``--<key>``.
"""
import glob
import importlib.util
import math
import os
import shlex

import pytest
import torch
from algo_helpers import ROOT, SMOKE, VARIED_REWARD, read_metrics, run_launcher

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))


def header(path: str) -> dict:
    out = {"requires": [], "launcher": "grpo", "prepare": []}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            key, sep, value = line[1:].strip().partition(":")
            if sep and key.strip() == "requires":
                out["requires"] = [r.strip() for r in value.split(",") if r.strip()]
            elif sep and key.strip() == "launcher":
                out["launcher"] = value.strip()
            elif sep and key.strip() == "prepare":
                target, eq, command = value.partition("=")
                assert eq, f"{path}: '# prepare: {value.strip()}' is not '<key> = <launcher> <flags>'"
                launcher, *flags = shlex.split(command)
                out["prepare"].append((target.strip(), launcher, flags))
    return out


def unmet(requirement: str):
    """None when ``requirement`` holds here, else why not; unknown names are an error."""
    checks = {
        "gpu": lambda: torch.cuda.is_available(),
        "megatron": lambda: importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None,
        "sglang": lambda: importlib.util.find_spec("sglang") is not None,
        "hub": lambda: os.environ.get("MEGAFORGE_TEST_HUB") == "1",
    }
    if requirement not in checks:
        raise AssertionError(f"unknown '# requires: {requirement}'; known: {', '.join(sorted(checks))}")
    return None if checks[requirement]() else f"needs {requirement}"


def check_run(run_dir: str, launcher: str):
    if launcher == "sft":
        recs = read_metrics(run_dir, "sft_metrics.jsonl")
        assert len(recs) == 2 and all(math.isfinite(r["loss"]) for r in recs)
        return recs
    recs = read_metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    from megaforge.metrics import REQUIRED_KEYS

    for r in recs:
        for k in REQUIRED_KEYS:
            assert k in r, k
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    return recs


def test_configs_found():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {"demo_cpu.yaml", "dapo_cpu.yaml", "sft_cpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.relpath(c, ROOT) for c in CONFIGS])
def test_config_runs_two_steps(path, tmp_path, in_root):
    h = header(path)
    assert h["launcher"] in ("grpo", "sft"), f"{path}: unknown '# launcher: {h['launcher']}'"
    reasons = [r for r in (unmet(x) for x in h["requires"]) if r]
    if reasons:
        pytest.skip(f"{os.path.relpath(path, ROOT)}: {'; '.join(reasons)} (its '# requires:' header)")
    made = []
    for i, (key, launcher, flags) in enumerate(h["prepare"]):
        assert launcher in ("grpo", "sft"), f"{path}: unknown launcher {launcher!r} in '# prepare:'"
        source = run_launcher(launcher, [*flags, *SMOKE], str(tmp_path), f"prepared_{i}")
        made += [f"--{key}", source]
    run = run_launcher(h["launcher"], ["--config", path, *SMOKE, *made], str(tmp_path), "smoke")
    recs = check_run(run, h["launcher"])
    if os.path.basename(path) == "dapo_cpu.yaml":
        assert all("dynamic_sampling/kept_groups" in r and "reward/overlong_penalty" in r for r in recs)


def test_custom_loss_example_command(tmp_path, in_root):
    """The command of examples/custom_loss/run.sh, as written there."""
    with open(os.path.join(ROOT, "examples", "custom_loss", "run.sh")) as f:
        text = f.read().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("python launchers/grpo.py"))
    argv = shlex.split(line)
    assert argv[:2] == ["python", "launchers/grpo.py"] and argv[-1] == "$@"
    run = run_launcher("grpo", argv[2:-1] + SMOKE[4:], str(tmp_path), "custom")  # keeps its 2 + 2 steps
    recs = check_run(run, "grpo")
    assert recs[-1]["kl"] != 0.0  # torchforge's beta * KL term is on


ALGOS = {
    "ppo_gae_critic": ["--algo.advantage", "gae", "--algo.kl_in_reward", "true", "--algo.lam", "0.95",
                       "--trainer.mini_batches", "2"],
    "reinforce_pp": ["--algo.advantage", "reinforce_pp", "--algo.kl_in_reward", "true", "--algo.gamma", "0.99"],
    "reinforce_pp_baseline": ["--algo.advantage", "reinforce_pp_baseline", "--algo.kl_in_reward", "true"],
    "gspo": ["--algo.loss", "gspo", "--algo.loss_agg", "seq_mean_token_mean", "--grpo.clip_low", "3e-4",
             "--grpo.clip_high", "4e-4"],
    "cispo_tis": ["--algo.loss", "cispo", "--algo.tis_cap", "2.0"],
    "sapo_rloo": ["--algo.loss", "sapo", "--algo.advantage", "rloo", "--algo.mis_threshold", "2.0",
                  "--algo.mis_level", "sequence"],
    "reinforce_dr_grpo": ["--algo.loss", "reinforce", "--algo.reinforce_clip", "0.2", "--algo.advantage", "dr_grpo",
                          "--algo.loss_agg", "seq_mean_token_sum_norm", "--algo.entropy_coef", "0.01"],
    "ppo_dual_clip_epochs": ["--algo.clip_c", "3.0", "--trainer.epochs", "2", "--algo.mis_threshold", "2.0",
                             "--algo.mis_threshold_low", "0.5", "--algo.mis_level", "geometric"],
}


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_algorithm_runs_two_steps(name, tmp_path, in_root):
    run = run_launcher("grpo", ["--config", "configs/demo_cpu.yaml", *SMOKE, *VARIED_REWARD, *ALGOS[name]],
                       str(tmp_path), name)
    recs = check_run(run, "grpo")
    assert all(r["grad_norm"] > 0 and r["skipped"] == 0 for r in recs)  # a real update every step
    if "--algo.kl_in_reward" in ALGOS[name]:
        assert recs[1]["kl"] != 0.0  # step 2 samples from the updated policy: KL to the reference
    if name == "ppo_gae_critic":
        assert all(r["critic/loss"] > 0 and r["critic/grad_norm"] > 0 for r in recs)
        assert recs[1]["critic/values"] != 0.0  # the value head has learned something after step 1
        ck = sorted(glob.glob(os.path.join(run, "checkpoints", "step_*", "trainer", "trainer.pt")))[-1]
        assert "critic" in torch.load(ck, map_location="cpu", weights_only=True)
