"""Weight sync into a real embedded engine server (CPU): ``shm`` (CPU shared-memory flattened buckets)
and ``disk`` (safetensors + /update_weights_from_disk) deliver the trainer's weights exactly (the
engine's logprobs equal the trainer's, and each other's), every sample carries the version it was
generated with, buckets respect ``sync.bucket_mb`` at the receiving end, and ``sync.check_equal``
catches a corrupted engine tensor, naming it, through /get_weights_checksum and the in-process engine
(SGLang's /weights_checker: tests/sync/test_sglang_checksum.py and tests/gpu)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "memory"))
from mem_helpers import make_batch, torch_trainer_cfg  # noqa: E402

from megaforge.sync import wire  # noqa: E402
from megaforge.sync import WeightMismatchError, check_engine_weights, push_weights  # noqa: E402
from megaforge.types import GenerateRequest, SamplingParams, TrainBatch  # noqa: E402
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(400)
PROMPTS = [[5, 17, 33, 9], [100, 101], [7, 8, 9, 10, 11], [40, 41, 42]]


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    from megaforge.trainer.torch_backend import TorchTrainer

    tr = TorchTrainer(RunBuilder(torch_trainer_cfg(tiny_model_dir, **{"grpo.beta": 0.0})).trainer_spec())
    tr.train_step(make_batch(vocab=512))  # weights differ from the checkpoint the server started from
    return tr


class Recorder:
    """Wraps the real clients' request method: (endpoint, bytes of a tensor bucket, tensors) per call."""

    def __init__(self, engine):
        self.calls = []
        for c in engine.clients:
            orig = c.request

            async def rec(method, endpoint, payload=None, _orig=orig, **kw):
                info = None
                if endpoint == "/update_weights_from_tensor":
                    obj = wire.deserialize(payload["serialized_named_tensors"][0])
                    info = (obj["flattened_tensor"].numel(), len(obj["metadata"]))
                self.calls.append((endpoint, info))
                return await _orig(method, endpoint, payload, **kw)

            c.request = rec


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory, tokenizer):
    """One embedded server; an shm client (launched it) and a disk client to the same server."""
    from megaforge.config import config_from_dict
    from megaforge.rollout import build_engine
    from megaforge.rollout.http.engine import HTTPEngine

    cfg = config_from_dict({
        "output_dir": str(tmp_path_factory.mktemp("run")), "run_name": "sync", "max_steps": 0,
        "model": {"path": tiny_model_dir, "dtype": "float32"}, "sync": {"transport": "shm"},
        "rollout": {"engine": "embedded_server", "device": "cpu", "startup_timeout_s": 180.0, "max_restarts": 0}})
    shm = build_engine(RunBuilder(cfg).engine_spec(), tokenizer)
    disk = HTTPEngine([c.url for c in shm.clients], transport="disk", model_dir=tiny_model_dir)
    yield shm, disk
    disk.shutdown()
    shm.shutdown()


def _generate(engine, seed: int):
    reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=[], seed=seed + i),
                            rid=f"r{i}") for i, p in enumerate(PROMPTS)]
    return engine.generate(reqs)


def _trainer_logprobs(trainer, comps):
    seqs = [p + c.output_ids for p, c in zip(PROMPTS, comps)]
    T = max(map(len, seqs))
    tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    lengths = torch.tensor([len(s) for s in seqs])
    z = torch.zeros(tokens.shape)
    lp = trainer.compute_logprobs(TrainBatch(tokens=tokens, lengths=lengths, loss_mask=z, advantages=z, rollout_logprobs=z))
    return [lp[b, len(p):len(p) + len(c.output_ids)] for b, (p, c) in enumerate(zip(PROMPTS, comps))]


def test_shm_and_disk_give_the_trainers_logprobs(trainer, engines):
    shm, disk = engines
    rec = Recorder(shm)
    max_bytes = 40_000  # the 128 KiB embedding is a bucket of its own; the rest split in several
    stats = push_weights(trainer, shm, max_bytes, 11)
    tensor_calls = [info for ep, info in rec.calls if ep == "/update_weights_from_tensor"]
    assert len(tensor_calls) == stats["buckets"] >= 3
    assert sum(n for n, _ in tensor_calls) == stats["bytes"] == sum(
        t.numel() * t.element_size() for bk in trainer.iter_hf_buckets(1 << 30) for _, t in bk)
    for nbytes, ntensors in tensor_calls:  # at the receiving end: within the bound, or a single tensor
        assert nbytes <= max_bytes or ntensors == 1
    assert any(nbytes > max_bytes for nbytes, _ in tensor_calls)
    a = _generate(shm, 100)
    assert {c.weight_version for c in a} == {11}, "every sample carries the version it was generated with"
    for got, want in zip([torch.tensor(c.output_logprobs) for c in a], _trainer_logprobs(trainer, a)):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # float32 engine vs trainer forward: ~1-2 ulp of |lp| <= 8

    push_weights(trainer, disk, 1 << 20, 12)
    b = _generate(shm, 100)
    assert {c.weight_version for c in b} == {12}
    # the same weights (bit for bit) by either transport, the same engine and requests: the same code
    # path on the same machine, so the samples and logprobs are equal exactly
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids and x.output_logprobs == y.output_logprobs

    trainer.train_step(make_batch(vocab=512, seed=1))  # new weights, through disk
    push_weights(trainer, disk, 1 << 20, 13)
    c = _generate(shm, 100)
    assert {x.weight_version for x in c} == {13}
    assert any(x.output_logprobs != y.output_logprobs for x, y in zip(b, c))
    for got, want in zip([torch.tensor(x.output_logprobs) for x in c], _trainer_logprobs(trainer, c)):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)  # float32 engine vs trainer forward: ~1-2 ulp of |lp| <= 8


def test_check_equal_catches_a_corrupted_engine_tensor(trainer, engines):
    shm, _ = engines
    stats = push_weights(trainer, shm, 1 << 20, 21, check_equal=True)
    assert stats["checked"] == stats["tensors"]
    name, t = next((n, t) for bk in trainer.iter_hf_buckets(1 << 30) for n, t in bk if n.endswith("mlp.up_proj.weight"))
    bad = t.detach().clone()
    bad[0, 0] += 0.5
    shm.update_weights([[(name, bad)]], 21)  # one engine tensor differs from the trainer's now
    with pytest.raises(WeightMismatchError, match=name.replace(".", r"\.")):
        check_engine_weights(trainer, shm)
    stats = push_weights(trainer, shm, 1 << 20, 22, check_equal=True)  # repaired by the next sync
    assert stats["checked"] == stats["tensors"]


def test_check_equal_in_process(trainer, tokenizer):
    from megaforge.rollout.embedded import EmbeddedEngine
    from megaforge.hf import load_hf_model

    engine = EmbeddedEngine(load_hf_model(trainer.cfg.model, torch.device("cpu")), tokenizer, fast="off")
    push_weights(trainer, engine, 1 << 20, 5, check_equal=True)
    name = "model.layers.1.self_attn.o_proj.weight"
    with torch.no_grad():
        engine.model.get_parameter(name)[3, 4] *= -1.5
    with pytest.raises(WeightMismatchError, match=name.replace(".", r"\.")):
        check_engine_weights(trainer, engine)


def test_ipc_needs_cuda_tensors(trainer, engines):
    from megaforge.rollout.http.engine import HTTPEngine

    ipc = HTTPEngine([c.url for c in engines[0].clients], transport="ipc")
    try:
        with pytest.raises(ValueError, match="'ipc' needs CUDA tensors"):
            push_weights(trainer, ipc, 1 << 20, 31)
    finally:
        ipc.shutdown()
