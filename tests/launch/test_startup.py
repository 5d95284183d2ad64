"""Issue 41 point 2 and 5: every component the config names is resolved at start-up and by --dry_run
(megaforge.startup): one ``megaforge: config error:`` line naming the key and the nearest name, before
the run directory, the tokenizer or the SFT warm start."""
import os
import sys
import textwrap

import pytest

from megaforge.config import load_config
from megaforge.configtree import ConfigError
from tests.run_helpers import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml")]


def dry(*argv):
    rc, out, err = run_in_process("grpo", [*DEMO, "--dry_run", *argv])
    return rc, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaforge: config error: "), err
    return lines[0]


def test_unknown_reward_name_fails_in_dry_run_with_did_you_mean():
    rc, err = dry("--rewards.functions", "[{name: maths}]")
    line = one_line(err)
    assert rc == 2 and "config key 'rewards.functions[0].name': unknown reward 'maths'" in line
    assert line.endswith("did you mean 'math'?")


def test_unknown_reward_fails_before_the_sft_warm_start(tmp_path, monkeypatch):
    from megaforge import loop

    def no_sft(self):
        raise AssertionError("the SFT warm start ran")

    monkeypatch.setattr(loop.Run, "sft", no_sft)
    rc, out, err = run_in_process("grpo", [*DEMO, "--rewards.functions", "[{name: maths}]", "--sft.max_steps", "5",
                                           "--output_dir", str(tmp_path), "--max_steps", "1"])
    assert rc == 2 and "did you mean 'math'?" in one_line(err)
    assert not os.path.exists(tmp_path / "demo_cpu")  # no run directory either
    os.chdir(ROOT)
    cfg = load_config([*DEMO, "--rewards.functions", "[{name: maths}]", "--output_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="did you mean 'math'"):  # the Python API: Run() resolves first
        loop.run_grpo(cfg)
    assert not os.path.exists(tmp_path / "demo_cpu")


@pytest.mark.parametrize("body,error", [("raise RuntimeError('boom at import')", "RuntimeError: boom at import"),
                                        ("import no_such_dependency_41", "No module named 'no_such_dependency_41'")])
def test_a_reward_module_that_fails_to_import_names_the_module_and_the_error(tmp_path, monkeypatch, body, error):
    (tmp_path / "bad_reward_41.py").write_text(f"{body}\n\ndef score(prompt, response, target):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bad_reward_41", None)
    rc, err = dry("--rewards.functions", "[{name: 'bad_reward_41:score'}]")
    line = one_line(err)
    assert rc == 2 and "config key 'rewards.functions[0].name'" in line and "'bad_reward_41'" in line
    assert error in line


def test_unknown_algo_names_are_caught_by_dry_run():
    rc, err = dry("--algo.loss", "ppo_clp")
    line = one_line(err)
    assert rc == 2 and "config key 'algo.loss': unknown policy loss 'ppo_clp'" in line
    assert line.endswith("did you mean 'ppo_clip'?")
    rc, err = dry("--algo.kl_estimator", "low_var")
    assert rc == 2 and "config key 'algo.kl_estimator'" in one_line(err)


def test_a_class_where_a_function_is_expected_is_refused_with_the_signature(tmp_path, monkeypatch):
    (tmp_path / "tf_loss_41.py").write_text(textwrap.dedent("""\
        import torch

        class CustomLoss(torch.nn.Module):  # torchforge's Workflow 2
            def forward(self, logprobs, ref_logprobs, advantages, padding_mask):
                return (logprobs * padding_mask).sum()

        def four_args(logprobs, old_logprobs, advantages, mask):
            return logprobs, {}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, err = dry("--algo.loss", "tf_loss_41:CustomLoss")
    line = one_line(err)
    assert rc == 2 and "config key 'algo.loss': 'tf_loss_41:CustomLoss' is a torch.nn.Module class" in line
    assert "fn(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams)" in line
    rc, err = dry("--algo.loss", "tf_loss_41:four_args")
    assert rc == 2 and "cannot be called as fn(logprobs, old_logprobs, advantages, mask, p" in one_line(err)


def test_generate_fn_and_reward_kwargs_are_resolved_at_start_up():
    rc, err = dry("--rollout.generate_fn", "no_such_module_41:fn")
    assert rc == 2 and "config key 'rollout.generate_fn'" in one_line(err)
    rc, err = dry("--rewards.functions", "[{name: math, kwargs: {bogus: 1}}]")
    assert rc == 2 and "config key 'rewards.functions[0].kwargs': reward 'math' does not take" in one_line(err)


@pytest.mark.parametrize("path,fmt", [("my.jsonl", "jsonl"), ("prompts/train.parquet", "parquet")])
def test_a_file_path_with_the_demo_synthetic_format_says_to_set_the_format(path, fmt):
    """Point 5: ``--data.path my.jsonl`` on the demo (format: synthetic) was "unknown synthetic task"."""
    rc, err = dry("--data.path", path)
    line = one_line(err)
    assert rc == 2 and f"config key 'data.path': '{path}' is a file path" in line
    assert f"set --data.format {fmt} (or auto)" in line and "unknown synthetic task" not in line
    rc, err = dry("--data.path", "arithmetc")
    assert rc == 2 and one_line(err).startswith("megaforge: config error: config key 'data.path': unknown synthetic "
                                                "task 'arithmetc'") and "did you mean 'arithmetic'?" in err
