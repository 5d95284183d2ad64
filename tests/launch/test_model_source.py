"""Issue 41 point 3: a model path that looks local and is not there is one config-error line at start-up,
with no hub call (it was 50-74 s of retries and a traceback); HF_HUB_OFFLINE is honoured; relative
paths of a config file are also read from its folder (megaforge.model_source, megaforge.config.paths)."""
import os
import shutil

import huggingface_hub
import huggingface_hub.file_download
import huggingface_hub.utils._http
import pytest

from megaforge import model_source
from megaforge.config import load_config
from tests.run_helpers import run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml")]


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a hub call was made")

    for name in ("hf_hub_download", "snapshot_download", "model_info", "get_session"):
        for mod in (huggingface_hub, huggingface_hub.file_download, huggingface_hub.utils._http):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, refuse)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaforge: config error: "), err
    return lines[0]


@pytest.mark.parametrize("path", ["/nope/model_41", "./nope_41", "../nope_41", "~/nope_41", "runs/x/hf/step_1"])
def test_a_missing_local_model_path_is_one_line_with_no_hub_call(no_network, tmp_path, path):
    """(A dry run plans for another machine, where the path may exist: the planner reports it there.)"""
    argv = [*DEMO, "--model.path", path, "--output_dir", str(tmp_path)]
    rc, out, err = run_in_process("grpo", argv)
    line = one_line(err)
    assert rc == 2 and f"config key 'model.path': '{path}' looks like a local path and does not exist" in line
    assert not os.listdir(tmp_path)


def test_the_loader_refuses_a_missing_local_path_before_transformers(no_network):
    from megaforge.hf import ModelSourceError, from_pretrained

    def load(*a, **k):
        raise AssertionError("transformers was called")

    with pytest.raises(ModelSourceError, match=r"^config key 'model.tokenizer': '/nope/tok' looks like a local path"):
        from_pretrained("model.tokenizer", "/nope/tok", load)


def test_hf_hub_offline_refuses_a_hub_id_not_in_the_cache(no_network, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    rc, out, err = run_in_process("grpo", [*DEMO, "--model.path", "someorg/not-cached-41", "--output_dir",
                                           str(tmp_path / "runs")])
    line = one_line(err)
    assert rc == 2 and "config key 'model.path': 'someorg/not-cached-41' is no folder under the current directory" in line
    assert "HF_HUB_OFFLINE" in line and not os.path.exists(tmp_path / "runs")
    (tmp_path / "hub" / "models--someorg--not-cached-41" / "snapshots" / "abc").mkdir(parents=True)
    assert model_source.problem("model.path", "someorg/not-cached-41") is None  # cached: left to transformers
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (tmp_path / "hub").rename(tmp_path / "gone")
    assert model_source.problem("model.path", "someorg/not-cached-41") is None  # online: the hub decides


def test_relative_paths_of_a_config_file_are_read_from_its_folder_after_the_cwd(tmp_path, monkeypatch):
    folder = tmp_path / "exp"
    shutil.copytree(os.path.join(ROOT, "configs", "models", "tiny-qwen2"), folder / "models" / "tiny")
    (folder / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (folder / "my.yaml").write_text("model: {config: models/tiny}\ndata: {path: prompts.jsonl}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(["--config", str(folder / "my.yaml")])
    assert cfg.model.config == str(folder / "models" / "tiny") and cfg.data.path == str(folder / "prompts.jsonl")
    (elsewhere / "prompts.jsonl").write_text('{"prompt": "2+2", "answer": "4"}\n')  # the cwd's comes first
    cfg = load_config(["--config", str(folder / "my.yaml"), "--model.config", "models/tiny"])
    assert cfg.data.path == "prompts.jsonl" and cfg.model.config == "models/tiny"  # the command line's untouched
