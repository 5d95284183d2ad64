"""Start-up checks of the off-policy, partial-rollout and multi-turn keys: each error names the key."""
import pytest

from loop_helpers import DEMO
from megaforge.config import load_config
from megaforge.configtree import ConfigError


def cfg(*args):
    return load_config(["--config", DEMO, *args])


@pytest.mark.parametrize("args,key", [
    (["--loop.mode", "off_policy"], "rollout.engine"),  # the in-process engine cannot overlap
    (["--loop.mode", "off_policy", "--rollout.engine", "embedded_server", "--loop.max_staleness", "0"],
     "loop.max_staleness"),
    (["--loop.mode", "off_policy", "--rollout.engine", "embedded_server", "--trainer.mini_batches", "2"],
     "loop.max_staleness"),  # one step of overlap ages samples by 2 versions > K = 1
    (["--loop.stale_policy", "correct"], "loop.stale_policy"),  # needs tis_cap or mis_threshold
    (["--loop.partial_rollouts", "true", "--loop.partial_old_tokens", "correct"], "loop.partial_old_tokens"),
    (["--loop.partial_rollouts", "true", "--rollout.generate_fn", "megaforge.rollout.agent.multiturn:tool_rollout"],
     "loop.partial_rollouts"),
    (["--loop.partial_budget_tokens", "-1"], "loop.partial_budget_tokens"),
    (["--rollout.max_turns", "0"], "rollout.max_turns"),
    (["--rollout.max_tool_tokens", "0"], "rollout.max_tool_tokens"),
])
def test_bad_combinations_name_the_key(args, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        cfg(*args)


def test_good_combinations():
    cfg("--loop.mode", "off_policy", "--rollout.engine", "embedded_server")
    cfg("--loop.mode", "off_policy", "--rollout.engine", "sglang", "--trainer.mini_batches", "2",
        "--loop.max_staleness", "2", "--loop.stale_policy", "correct", "--algo.tis_cap", "2")
    cfg("--loop.partial_rollouts", "true", "--loop.partial_old_tokens", "correct", "--algo.mis_threshold", "2")
    cfg("--rollout.generate_fn", "megaforge.rollout.agent.multiturn:tool_rollout",
        "--rollout.generate_kwargs", "{tools: [calculator, python]}")
