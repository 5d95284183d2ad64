"""Runs that cannot learn say so (issue 41, point 6): the per-step fraction of groups whose rewards are
all equal (``groups/zero_variance_frac``) and of trained tokens with a nonzero advantage
(``advantages/nonzero_frac``), one warning line after ``metrics.warn_no_signal_steps`` consecutive steps
of all-zero advantages, a config error for a group baseline with one sample per prompt, and a README
override example that keeps the SFT warm start (its runs learn: reward rises)."""
import os
import re
import shlex

import pytest
from run_helpers import lines, run_in_process

from megaforge.config import load_config
from megaforge.configtree import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
# the untrained demo model never earns a reward: every group's rewards are equal (0)
COLD = ["--config", DEMO, "--sft.max_steps", "0", "--rollout.batch_size", "2", "--grpo.n_samples", "2",
        "--rollout.max_new_tokens", "6", "--metrics.progress", "false", "--metrics.tensorboard", "false",
        "--metrics.log_samples", "0", "--rollout.device", "cpu", "--run_name", "r"]


def warnings(err: str) -> list[str]:
    return [l for l in err.splitlines() if l.startswith("megaforge: warning: RL steps")]


def test_a_run_without_signal_logs_it_and_warns_once(tmp_path):
    rc, _, err = run_in_process("grpo", [*COLD, "--output_dir", str(tmp_path), "--max_steps", "4"])
    assert rc == 0, err[-2000:]
    rows = lines(str(tmp_path / "r" / "metrics.jsonl"))
    assert [r["groups/zero_variance_frac"] for r in rows] == [1.0] * 4
    assert [r["advantages/nonzero_frac"] for r in rows] == [0.0] * 4
    got = warnings(err)
    assert len(got) == 1, err[-3000:]  # once, when the third step in a row had no signal
    assert got[0].startswith("megaforge: warning: RL steps 1-3: every advantage was 0")
    assert "sft.max_steps > 0, now 0" in got[0]


def test_the_warning_can_be_turned_off_and_waits_for_its_count(tmp_path):
    rc, _, err = run_in_process("grpo", [*COLD, "--output_dir", str(tmp_path), "--max_steps", "3",
                                         "--metrics.warn_no_signal_steps", "0"])
    assert rc == 0 and warnings(err) == [], err[-2000:]
    rc, _, err = run_in_process("grpo", [*COLD, "--output_dir", str(tmp_path), "--run_name", "r2", "--max_steps", "2"])
    assert rc == 0 and warnings(err) == [], err[-2000:]


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_baseline_with_one_sample_per_prompt_is_a_config_error(advantage):
    with pytest.raises(ConfigError, match=r"config key 'grpo.n_samples': algo.advantage " + advantage
                       + r" .* every advantage is 0 .* set grpo.n_samples >= 2"):
        load_config(["--config", DEMO, "--grpo.n_samples", "1", "--algo.advantage", advantage])


def test_one_sample_per_prompt_is_fine_where_it_can_learn():
    assert load_config(["--config", DEMO, "--grpo.n_samples", "1", "--algo.advantage", "reinforce_pp"]).grpo.n_samples == 1
    assert load_config(["--config", DEMO, "--grpo.n_samples", "1", "--max_steps", "0"]).max_steps == 0  # SFT only


def test_the_config_error_is_one_line_from_the_launcher():
    rc, _, err = run_in_process("grpo", ["--config", DEMO, "--grpo.n_samples", "1"])
    assert rc == 2 and err.startswith("megaforge: config error: config key 'grpo.n_samples'") and err.count("\n") == 1


def readme_override_example() -> list[str]:
    """The arguments of the README's override example (the Configuration section's first command)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = re.search(r"```bash\n(python launchers/grpo.py --config configs/demo_cpu.yaml --grpo[^`]*?)\n(?:python|```)",
                      text).group(1)
    return shlex.split(block.replace("\\\n", " "))[2:]


def test_the_readme_override_example_keeps_a_warm_start():
    """The example's run learned on 2 CPU cores (reward/mean 0.10 at step 1, 0.18-0.22 over steps
    16-20); from a cold start (sft.max_steps 0) its reward stays 0 at every step."""
    argv = readme_override_example()
    cfg = load_config(argv)
    assert cfg.sft.max_steps >= 100 and cfg.max_steps == 20 and cfg.grpo.n_samples >= 2, argv


@pytest.mark.slow
def test_the_readme_override_example_learns(tmp_path):
    """The README's example as written (its output folder moved here): reward/mean over the last 5 RL
    steps above that of the first 3 by more than 0.05 (measured: 0.09 -> 0.20)."""
    argv = readme_override_example() + ["--output_dir", str(tmp_path), "--metrics.progress", "false",
                                        "--metrics.log_samples", "0"]
    rc, _, err = run_in_process("grpo", argv)
    assert rc == 0 and warnings(err) == [], err[-2000:]
    rewards = [r["reward/mean"] for r in lines(str(tmp_path / "try2" / "metrics.jsonl"))]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3 + 0.05, rewards
