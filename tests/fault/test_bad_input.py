"""Bad input gives a clear message and loses nothing already written. The runs run in the test's process
(run_helpers.run_in_process)."""
import json
import os
import pytest
from run_helpers import completed_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--config", DEMO, "--sft.max_steps", "0", "--rollout.batch_size", "2", "--grpo.n_samples", "2",
        "--rollout.max_new_tokens", "8", "--metrics.progress", "false"]


def launch(out, *extra):
    return completed_in_process("grpo", [*TINY, "--output_dir", out, *extra])


def test_nan_loss_steps_skipped_then_stop(tmp_path):
    p = launch(str(tmp_path), "--run_name", "n", "--max_steps", "10", "--algo.loss", "nan_loss:nan_loss",
               "--trainer.max_bad_steps", "3")
    assert p.returncode == 1
    assert "3 consecutive steps had a non-finite loss or gradient in every update (trainer.max_bad_steps=3)" in p.stderr
    # each skipped update names the gradients (a NaN loss makes every one of them NaN)
    skips = [ln for ln in p.stderr.splitlines() if ln.startswith("[megaforge] optimizer update skipped: ")]
    assert len(skips) == 3 and all("non-finite gradient in" in ln and "model.embed_tokens.weight" in ln
                                   for ln in skips), skips
    recs = [json.loads(l) for l in open(tmp_path / "n" / "metrics.jsonl")]
    assert [r["health/skipped_steps"] for r in recs] == [1.0, 2.0, 3.0]
    assert [r["health/skipped_updates"] for r in recs] == [1.0, 2.0, 3.0]
    assert all(r["weight_version"] == 0.0 for r in recs)  # nothing was applied


def test_some_updates_skipped_the_run_goes_on(tmp_path):
    """A step that applied some of its updates learned something: it is not a bad step (GSM8K run 2
    stopped on 3 consecutive steps with 1 of 4 updates skipped each, 9 of 12 applied)."""
    p = launch(str(tmp_path), "--run_name", "h", "--max_steps", "4", "--algo.loss", "nan_loss:nan_first_of_two",
               "--trainer.max_bad_steps", "2", "--trainer.mini_batches", "2", "--trainer.micro_batch_size", "64")
    assert p.returncode == 0, p.stderr[-2000:]
    recs = [json.loads(l) for l in open(tmp_path / "h" / "metrics.jsonl")]
    assert [r["updates"] for r in recs] == [2.0] * 4 and [r["skipped"] for r in recs] == [1.0] * 4
    assert [r["health/skipped_updates"] for r in recs] == [1.0, 2.0, 3.0, 4.0]
    assert [r["health/skipped_steps"] for r in recs] == [1.0, 2.0, 3.0, 4.0]
    assert [r["weight_version"] for r in recs] == [1.0, 2.0, 3.0, 4.0]  # the second update of each step


@pytest.mark.slow
def test_malformed_row_mid_run_keeps_earlier_steps(tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(4)]
    rows.insert(4, '{"prompt": "What is 9 + 1?", "answer": ')  # line 5: cut short
    data.write_text("\n".join(rows) + "\n")
    p = launch(str(tmp_path), "--run_name", "m", "--max_steps", "4", "--data.path", str(data), "--data.format", "jsonl",
               "--data.shuffle", "false")
    assert p.returncode == 1
    assert f"{data}:5: not valid JSON" in p.stderr
    assert "Traceback" not in p.stderr
    assert "RL step 2 is checkpointed: fix the input and continue with --resume" in p.stderr
    recs = [json.loads(l) for l in open(tmp_path / "m" / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [1, 2]  # the two full batches before the bad row stay
    assert os.listdir(tmp_path / "m" / "checkpoints") == ["step_000002"]
    skipped = launch(str(tmp_path), "--run_name", "m2", "--max_steps", "3", "--data.path", str(data),
                     "--data.format", "jsonl", "--data.shuffle", "false", "--data.skip_bad_rows", "true")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    recs = [json.loads(l) for l in open(tmp_path / "m2" / "metrics.jsonl")]
    assert recs[-1]["data/skipped_rows"] >= 1


def test_gpu_that_does_not_exist(tmp_path):
    p = launch(str(tmp_path), "--run_name", "g", "--max_steps", "1", "--trainer.device", "cuda:3")
    assert p.returncode == 1 and "device 'cuda:3' requested but this machine has" in p.stderr
    assert "Traceback" not in p.stderr
