"""Checkpoint pruning counts valid checkpoints only and never deletes the one resumed from;
non-finite weights and failed writes (a full disk) are refused with a clear error and leave no
``.tmp-`` folder behind."""
import errno
import os
import subprocess

import pytest
import torch

from megaforge import checkpoint


class FileTrainer:
    """The part of the trainer interface checkpoint.save uses: a weight file written the way the
    torch backend writes it."""

    def __init__(self, value: float = 1.0):
        self.w = torch.full((256,), value)

    def save(self, path):
        os.makedirs(path)
        checkpoint.write_torch({"w": self.w}, os.path.join(path, "trainer.pt"))

    def load(self, path):
        self.w = torch.load(os.path.join(path, "trainer.pt"), weights_only=True)["w"]


def _names(d):
    return sorted(os.listdir(d))


def _corrupt(path):
    f = os.path.join(path, "trainer", "trainer.pt")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)


def test_pruning_after_a_fallback_keeps_what_resumes(tmp_path):
    """The issue's case: the newest checkpoints are corrupt, the run falls back to an older one,
    then saves and prunes. The old pruning kept the highest step numbers (the corrupt ones) and
    deleted the checkpoint resumed from and the new one: the next resume found nothing."""
    d = str(tmp_path)
    for step in (2, 4, 6):
        checkpoint.save(d, step, FileTrainer(step), {"rl_step": step}, keep_last_n=3)
    _corrupt(os.path.join(d, "step_000004"))
    _corrupt(os.path.join(d, "step_000006"))
    resumed = checkpoint.latest_valid(d, log=lambda m: None)
    assert resumed == os.path.join(d, "step_000002")
    checkpoint.save(d, 3, FileTrainer(3), {"rl_step": 3}, keep_last_n=2, protect=[resumed])
    assert _names(d) == ["step_000002", "step_000003"]  # the corrupt ones went, not the valid ones
    assert checkpoint.latest_valid(d) == os.path.join(d, "step_000003")
    for step in (4, 5):
        checkpoint.save(d, step, FileTrainer(step), {"rl_step": step}, keep_last_n=2, protect=[resumed])
    assert _names(d) == ["step_000002", "step_000004", "step_000005"]  # resumed-from kept all run long
    tr = FileTrainer(0)
    assert checkpoint.load(checkpoint.latest_valid(d), tr) == {"rl_step": 5} and tr.w[0] == 5
    checkpoint.save(d, 6, FileTrainer(6), {"rl_step": 6}, keep_last_n=1)  # the next run resumed from 5
    assert _names(d) == ["step_000006"]


def test_corrupt_checkpoints_never_count_and_the_newest_valid_one_stays(tmp_path):
    d = str(tmp_path)
    for step in (1, 2, 3):
        checkpoint.save(d, step, FileTrainer(step), {"rl_step": step}, keep_last_n=5)
    _corrupt(os.path.join(d, "step_000003"))
    deleted = checkpoint.prune(d, keep_last_n=1, log=lambda m: None)
    assert deleted == [os.path.join(d, "step_000001"), os.path.join(d, "step_000003")]
    assert _names(d) == ["step_000002"]


def test_non_finite_weights_are_never_written(tmp_path, tiny_model_dir, tokenizer):
    from megaforge.config import config_from_dict
    from megaforge.build import RunBuilder
    from megaforge.trainer.base import NonFiniteWeights

    cfg = config_from_dict({"model": {"path": tiny_model_dir}, "trainer": {"device": "cpu"}, "max_steps": 0})
    tr = RunBuilder(cfg).trainer(tokenizer)
    tr.reset_optimizer(1e-3, 10, 0, "constant")
    d = str(tmp_path / "ckpt")
    checkpoint.save(d, 1, tr, {"rl_step": 1}, keep_last_n=2)
    name, p = next((n, p) for n, p in tr.model.named_parameters() if n.endswith("mlp.up_proj.weight"))
    with torch.no_grad():
        p[0, 0] = float("inf")
    with pytest.raises(NonFiniteWeights, match=rf"1 weight tensor\(s\) hold NaN or inf \(rank 0: model\.{name}\); "
                                               r"no checkpoint was written"):
        checkpoint.save(d, 2, tr, {"rl_step": 2}, keep_last_n=2)
    assert _names(d) == ["step_000001"]  # nothing written, no .tmp- left, the earlier one intact
    assert checkpoint.verify(os.path.join(d, "step_000001")) is None


def test_full_disk_names_path_and_cause_and_leaves_no_tmp(tmp_path, monkeypatch):
    """ENOSPC injected at the write call (the torch backend writes through a Python file)."""
    d = str(tmp_path)
    checkpoint.save(d, 1, FileTrainer(1), {"rl_step": 1}, keep_last_n=2)
    real = torch.save

    def full_disk(obj, f, *a, **kw):
        real(obj, f, *a, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=rf"writing checkpoint {d}/step_000002 failed: No space left on device \(ENOSPC\); .* MiB "
                             r"free on its filesystem\. The partial write was removed"):
        checkpoint.save(d, 2, FileTrainer(2), {"rl_step": 2}, keep_last_n=2)
    assert _names(d) == ["step_000001"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_disk_on_a_real_small_filesystem(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        big = FileTrainer()
        big.w = torch.zeros(1 << 16)  # 256 KiB: more than the filesystem holds
        with pytest.raises(checkpoint.CheckpointWriteError, match=r"No space left on device \(ENOSPC\)"):
            checkpoint.save(str(mnt), 1, big, {"rl_step": 1}, keep_last_n=2)
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
