"""tools/common.py: the provenance every tool's JSON line carries (commit of a clean, dirty, copied or
git-less checkout), the synthetic RL batch and the model configs of configs/models/."""
import json
import os
import shutil
import subprocess

import pytest
import torch

import common

GIT = shutil.which("git")
ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
       "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **ENV}).stdout.strip()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A one-commit repository (a worktree of it beside), $MEGAFORGE_COMMIT unset."""
    if GIT is None:
        pytest.fail("git is not on PATH")
    monkeypatch.delenv("MEGAFORGE_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "commit", "-q", "-m", "one")
    return repo, git(repo, "rev-parse", "HEAD")


def test_commit_of_a_clean_then_dirty_checkout(checkout):
    repo, sha = checkout
    assert common.commit(str(repo)) == sha
    (repo / "a.py").write_text("x = 2\n")
    assert common.commit(str(repo)) == sha + "-dirty"
    git(repo, "checkout", "-q", "a.py")
    (repo / "new.py").write_text("")  # untracked, not ignored: a change too
    assert common.commit(str(repo)) == sha + "-dirty"


def test_commit_without_git_reads_head_and_says_unverified(checkout, tmp_path, monkeypatch):
    repo, sha = checkout
    wt = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", "-b", "side", str(wt))
    git(repo, "pack-refs", "--all")  # refs now in packed-refs only
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert common.commit(str(repo)) == sha + "-unverified"
    assert common.commit(str(wt)) == sha + "-unverified"  # .git is a file: gitdir, commondir, packed-refs


def test_commit_of_a_copy_without_git_is_unknown_unless_given(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGAFORGE_COMMIT", raising=False)
    copy = tmp_path / "copy"
    copy.mkdir()
    assert common.commit(str(copy)) == "unknown"
    monkeypatch.setenv("MEGAFORGE_COMMIT", "abc123")
    assert common.commit(str(copy)) == "abc123"


def test_emit_adds_provenance_and_refuses_to_overwrite_it(capsys):
    line = common.emit({"tool": "x", "device": "as the tool says"})
    printed = json.loads(capsys.readouterr().out)
    assert printed == line and printed["device"] == "as the tool says"
    prov = printed["provenance"]
    assert set(prov) == {"commit", "device", "torch", "megaforge"}
    assert prov["torch"] == torch.__version__ and prov["device"] == "cpu" and prov["commit"]
    with pytest.raises(ValueError, match="provenance"):
        common.emit({"provenance": 1})


def test_rl_batch_masks_the_responses_and_counts_them():
    b = common.rl_batch([5, 3], vocab=7, prompt_lens=[2, 3], width=6, seed=1)
    assert b.tokens.shape == (2, 6) and (b.tokens[0, 5:] == 0).all() and (b.tokens[1, 3:] == 0).all()
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]]
    assert (b.num_tokens, b.num_seqs) == (3, 1)
    assert ((b.advantages != 0) == (b.loss_mask > 0)).all() and ((b.rollout_logprobs != 0) == (b.loss_mask > 0)).all()
    again = common.rl_batch([5, 3], vocab=7, prompt_lens=[2, 3], width=6, seed=1)
    assert torch.equal(again.tokens, b.tokens) and torch.equal(again.advantages, b.advantages)


def test_model_config_reads_configs_models_by_name_or_a_shape():
    cfg = common.model_config("tiny-qwen2", vocab_size=300)
    assert (cfg.model_type, cfg.hidden_size, cfg.vocab_size) == ("qwen2", 128, 300)
    shape = common.model_config({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2})
    assert type(shape).__name__ == "LlamaConfig" and shape.hidden_size == 32
    with pytest.raises(FileNotFoundError, match="tiny-qwen2"):  # the error lists configs/models/
        common.model_config("tiny-qwen9")
