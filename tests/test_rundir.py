"""The run-directory lock (megaforge.rundir): it never writes through a planted ``.lock``."""
import os

import pytest

from megaforge.rundir import RunDirBusy, RunDirError, RunDirLock


def test_lock_refuses_a_symlink_and_leaves_its_target_untouched(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("do not truncate me\n")
    os.symlink(victim, run / ".lock")
    with pytest.raises(RunDirError, match=r"run directory lock .*/run/\.lock is a symlink: remove it"):
        RunDirLock(str(run))
    assert victim.read_text() == "do not truncate me\n"
    os.unlink(run / ".lock")
    os.symlink(tmp_path / "missing", run / ".lock")  # a dangling link would create its target
    with pytest.raises(RunDirError, match="is a symlink"):
        RunDirLock(str(run))
    assert not (tmp_path / "missing").exists()


def test_lock_refuses_a_fifo_and_a_directory(tmp_path):
    os.mkfifo(tmp_path / ".lock")
    with pytest.raises(RunDirError, match=r"\.lock is not a regular file"):
        RunDirLock(str(tmp_path))
    other = tmp_path / "d"
    (other / ".lock").mkdir(parents=True)
    with pytest.raises(RunDirError, match=r"d/\.lock is not a regular file"):
        RunDirLock(str(other))


def test_lock_is_exclusive_and_records_its_holder(tmp_path):
    lock = RunDirLock(str(tmp_path))
    assert (tmp_path / ".lock").read_text().startswith(f"{os.getpid()}@")
    with pytest.raises(RunDirBusy, match=f"in use by process {os.getpid()}@"):
        RunDirLock(str(tmp_path))
    lock.release()
    RunDirLock(str(tmp_path)).release()
