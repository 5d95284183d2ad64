"""tools/gpu/carry_size.py counts what the run tool copies: tracked and untracked-not-ignored files plus the
carried (ignored) paths, and refuses more than 64 MiB or a missing carry path."""
import json
import os
import subprocess

import carry_size


def git_tree(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/kit/\n")
    (tmp_path / "tracked.txt").write_bytes(b"a" * 1000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.txt", ".gitignore"], check=True)
    (tmp_path / "untracked.txt").write_bytes(b"b" * 200)  # copied too: not ignored
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "part").write_bytes(b"c" * 300)  # ignored: only when carried
    (kit / "big").write_bytes(b"")
    return tmp_path


def test_counts_the_tree_and_the_carried_paths(tmp_path, monkeypatch, capsys):
    root = git_tree(tmp_path)
    monkeypatch.chdir(root)
    assert carry_size.tree_bytes() == 1000 + 200 + len("/kit/\n")
    assert carry_size.main(["kit/part"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["carry_bytes"] == {"kit/part": 300} and out["fits"] and out["missing"] == []


def test_refuses_over_the_limit_and_missing_paths(tmp_path, monkeypatch, capsys):
    root = git_tree(tmp_path)
    monkeypatch.chdir(root)
    with open(os.path.join("kit", "big"), "wb") as f:  # sparse: 64 MiB exactly, plus the tree's bytes
        f.truncate(64 * 2**20)
    assert carry_size.main(["kit"]) == 1
    assert not json.loads(capsys.readouterr().out)["fits"]
    assert carry_size.main(["kit/part", "kit/nothing"]) == 1
    assert json.loads(capsys.readouterr().out)["missing"] == ["kit/nothing"]
