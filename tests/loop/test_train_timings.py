"""The parts of ``time/train`` (megaforge.driver.steps.train_share): the forwards before the update
(``time/train/ref``, ``/pi_old``, ...) and the optimizer steps (``time/train/update``), each present
exactly when the step runs it, together within ``time/train``. Issue 39 compares megaforge's pi_old
and update phases with verl's ``timing_s/old_log_prob`` / ``update_actor`` (tools/peers)."""
import json
import os

import pytest
from run_helpers import ROOT, run_in_process

DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--sft.max_steps", "0", "--rollout.batch_size", "4", "--grpo.n_samples", "4", "--rollout.max_new_tokens", "8",
        "--max_steps", "2", "--metrics.progress", "false", "--metrics.tensorboard", "false"]
PARTS = ("time/train/ref", "time/train/pi_old", "time/train/values", "time/train/teacher", "time/train/update")


@pytest.mark.parametrize("extra, parts", [
    ([], {"time/train/ref", "time/train/update"}),  # the demo: beta > 0 (a reference), one update a batch
    (["--trainer.mini_batches", "2"], {"time/train/ref", "time/train/pi_old", "time/train/update"}),  # pi_old fixed
    (["--grpo.beta", "0", "--trainer.mini_batches", "2"], {"time/train/pi_old", "time/train/update"}),
], ids=["one_update", "two_updates", "two_updates_no_ref"])
def test_train_time_parts(tmp_path, extra, parts):
    rc, out, err = run_in_process("grpo", ["--config", DEMO, *TINY, "--output_dir", str(tmp_path), "--run_name", "t", *extra])
    assert rc == 0, out[-2000:] + err[-2000:]
    with open(os.path.join(tmp_path, "t", "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert len(recs) == 2
    for r in recs:
        assert {k for k in PARTS if k in r} == parts, r
        assert all(r[k] > 0 for k in parts)
        assert sum(r[k] for k in parts) <= r["time/train"], r  # nested in time/train
