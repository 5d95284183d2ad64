"""The off-policy checkpoint's in-flight batch (megaforge.driver.offpolicy): written as a safetensors
file with its shapes in state.json, read back exactly; a truncated, missing or mismatched file is an
error naming it; the older format (tensors as JSON lists) still reads."""
import json
import os

import pytest
import torch

from megaforge.checkpoint import write_tensors
from megaforge.data.batch import samples_to_batch
from megaforge.driver.common import RunError
from megaforge.driver.offpolicy import INFLIGHT_FILE, batch_layout, batch_tensors, saved_batch
from megaforge.types import Sample, TrainBatch


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=[5, 6, 7][: 1 + i % 3], response_ids=list(range(10, 10 + i)),
                      rollout_logprobs=(-torch.rand(i, generator=g)).tolist(), group_id=i // 2, reward=0.1 * i,
                      weight_version=i % 2) for i in range(1, 7)]
    return samples_to_batch(samples, pad_id=0)


def save(tmp_path, b: TrainBatch) -> dict:
    """What AsyncDriver.before_save and the checkpoint write: the file, and state.json's record."""
    write_tensors(batch_tensors(b), str(tmp_path / INFLIGHT_FILE))
    return json.loads(json.dumps({"batch": batch_layout(b), "file": INFLIGHT_FILE, "metrics": {"reward/mean": 0.5}}))


def test_round_trip_is_exact_and_the_json_holds_shapes_only(tmp_path):
    b = batch()
    st = save(tmp_path, b)
    assert st["batch"]["tokens"] == {"dtype": "int64", "shape": list(b.tokens.shape)}
    got = saved_batch(st, str(tmp_path))
    for name in TrainBatch.TENSOR_FIELDS:
        want = getattr(b, name)
        assert (getattr(got, name) is None) == (want is None), name
        if want is not None:
            assert getattr(got, name).dtype == want.dtype and torch.equal(getattr(got, name), want), name
    assert (got.num_tokens, got.num_seqs) == (b.num_tokens, b.num_seqs)


def test_truncated_missing_or_mismatched_file_names_it(tmp_path):
    st = save(tmp_path, batch())
    path = str(tmp_path / INFLIGHT_FILE)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(RunError, match=f"{path}.*truncated or damaged"):
        saved_batch(st, str(tmp_path))
    os.remove(path)
    with pytest.raises(RunError, match=f"{path}: no such file"):
        saved_batch(st, str(tmp_path))
    other = batch().select(slice(0, 3))  # a file of another batch than state.json records
    write_tensors(batch_tensors(other), path)
    with pytest.raises(RunError, match=f"{path}: tensor 'tokens' is .* state.json records"):
        saved_batch(st, str(tmp_path))


def test_older_json_format_still_reads():
    b = batch()
    old = {"batch": {n: {"dtype": str(t.dtype).removeprefix("torch."), "data": t.tolist()}
                     for n, t in batch_tensors(b).items()}, "metrics": {}}
    got = saved_batch(json.loads(json.dumps(old)), None)
    assert torch.equal(got.tokens, b.tokens) and torch.equal(got.rollout_logprobs, b.rollout_logprobs)
