"""``model.path`` accepts a megaforge run folder or one of its checkpoints (issue 41, point 9): an SFT run
hands its policy to a GRPO run (megaforge.handoff_source writes it as ``<run>/source_model``), which
starts from exactly the SFT weights."""
import os

import pytest
import torch
from run_helpers import lines, run_in_process
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = ["--metrics.progress", "false", "--metrics.tensorboard", "false", "--metrics.log_samples", "0",
         "--rollout.device", "cpu"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    rc, _, err = run_in_process("sft", ["--config", os.path.join(ROOT, "configs", "sft_cpu.yaml"), "--sft.max_steps",
                                        "3", "--output_dir", str(out), "--run_name", "s", *QUIET])
    assert rc == 0, err[-2000:]
    return out / "s"


@pytest.mark.parametrize("which", ["run", "checkpoint"])
def test_a_grpo_run_starts_from_an_sft_run(tmp_path, sft_run, which):
    src = sft_run if which == "run" else sft_run / "checkpoints" / "sft_step_000003"
    rc, out, err = run_in_process("grpo", [
        "--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--model.path", str(src), "--sft.max_steps", "0",
        "--max_steps", "1", "--rollout.batch_size", "2", "--grpo.n_samples", "2", "--rollout.max_new_tokens", "4",
        "--output_dir", str(tmp_path), "--run_name", "g", *QUIET])
    assert rc == 0, err[-2000:]
    assert f"model.path {src}: the policy of {sft_run / 'checkpoints' / 'sft_step_000003'}" in out
    saved = torch.load(sft_run / "checkpoints" / "sft_step_000003" / "trainer" / "trainer.pt", weights_only=True)["model"]
    got = load_file(str(tmp_path / "g" / "source_model" / "model.safetensors"))
    for name, t in got.items():
        assert torch.equal(t, saved[name]), name
    assert len(lines(str(tmp_path / "g" / "metrics.jsonl"))) == 1


def test_a_folder_that_is_no_run_is_named(tmp_path):
    (tmp_path / "m" / "checkpoints").mkdir(parents=True)
    rc, _, err = run_in_process("grpo", ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--model.path",
                                         str(tmp_path / "m"), "--output_dir", str(tmp_path), "--run_name", "g", *QUIET])
    assert rc == 1 and err.strip() == (f"megaforge: error: model.path {tmp_path / 'm'}: the run has no complete "
                                       f"checkpoint under checkpoints/")
