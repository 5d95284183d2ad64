"""Trainer.warm_up (megaforge.trainer.base) on the torch backend, and its runner beside the engine
start (megaforge.trainer.warm_up.WarmUp): the warm-up runs pi_old's forward and the policy
objective's forward and backward and leaves no trace: weights, optimizer state, weight version and
the random streams as before, gradients cleared, and the next RL step equal to a trainer's that did
not warm up. What it is for (no torch.compile in step 1) happens on CUDA only:
tests/gpu/test_warm_up_cuda.py. The Megatron backend's: tests/megatron/test_warm_up_megatron.py.

Tolerance: none. The two trainers run the same float32 ops in the same order on the same inputs in
one process, so their weights and metrics are equal to the bit (not a rounding claim across machines)."""
import pytest
import torch
from test_trainer_skeleton import _batch

from megaforge.build import RunBuilder
from megaforge.config import config_from_dict
from megaforge.trainer.warm_up import WarmUp


@pytest.fixture
def cfg(tiny_model_dir):
    return config_from_dict({"model": {"path": tiny_model_dir, "dtype": "float32"}, "max_steps": 2, "seed": 0,
                             "data": {"path": "arithmetic", "format": "synthetic"},
                             "trainer": {"backend": "torch", "device": "cpu", "lr": 1e-2, "mini_batches": 2}})


def test_warm_up_leaves_no_trace(cfg, tokenizer, monkeypatch):
    a, b = RunBuilder(cfg).trainer(tokenizer), RunBuilder(cfg).trainer(tokenizer)
    calls = []
    real_fb, real_lp = a._forward_backward, a.compute_logprobs
    monkeypatch.setattr(a, "_forward_backward", lambda mini, obj: calls.append(("fb", mini.batch_size)) or real_fb(mini, obj))
    monkeypatch.setattr(a, "compute_logprobs", lambda share, *x, **k: calls.append(("lp", share.batch_size))
                        or real_lp(share, *x, **k))
    before = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    rng = torch.get_rng_state()
    a.warm_up()
    # two batches, other lengths the second time; the second mini-batch of each is not run
    assert calls == [("lp", 2), ("fb", 1), ("lp", 4), ("fb", 2)]
    assert torch.equal(torch.get_rng_state(), rng)
    assert a.version == 0 and not a.opt.state and a.sched["step"] == 0
    for n, p in a.model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n
    monkeypatch.undo()
    batch = _batch()
    assert a.train_step(batch) == b.train_step(batch)
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name


class CudaTrainerDouble:
    """What WarmUp reads of a trainer (``device``, ``warm_up()``) with a CUDA device, which this
    machine has not; the real trainers on CUDA: tests/gpu/test_warm_up_cuda.py."""

    def __init__(self, error=None):
        self.device, self.error, self.threads = torch.device("cuda"), error, []

    def warm_up(self):
        import threading
        self.threads.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error


def test_warm_up_runner(cfg, tokenizer):
    cpu = RunBuilder(cfg).trainer(tokenizer)
    assert WarmUp(cpu).wait() is None  # the CPU compiles nothing: no warm-up
    ok = CudaTrainerDouble()
    assert WarmUp(ok).wait() >= 0.0 and ok.threads == ["megaforge-warm-up"]  # one process: on its thread
    bad = WarmUp(CudaTrainerDouble(ValueError("out of memory in the warm-up")))
    with pytest.raises(RuntimeError, match=r"the trainer's warm-up before step 1 failed: ValueError: out of memory"):
        bad.wait()


def test_warm_up_scores_with_the_frozen_models_the_step_uses(tiny_model_dir, tokenizer, monkeypatch):
    """A trainer-served distillation teacher and a held reference have their own forward (the teacher its own
    shapes, hence its own compiled graphs): the warm-up runs them too, each after pi_old's forward, and they
    stay unchanged. Without it the distillation run on the H100 compiled 7 graphs in step 1, the GRPO recipe's
    runs 3 (its teacher pass 5.25 s there against 1.81 s later; docs/benchmarks/README.md, 2026-12-07 fifth session)."""
    cfg = config_from_dict({"model": {"path": tiny_model_dir, "dtype": "float32"}, "max_steps": 2, "seed": 0,
                            "data": {"path": "arithmetic", "format": "synthetic"}, "algo": {"advantage": "distill"},
                            "teacher": {"path": tiny_model_dir}, "grpo": {"beta": 0.1},
                            "trainer": {"backend": "torch", "device": "cpu", "lr": 1e-2, "mini_batches": 2}})
    tr = RunBuilder(cfg).trainer(tokenizer)
    tr.snapshot_reference()
    assert tr.teacher is not None and tr.ref is not None
    calls, real_lp = [], tr.compute_logprobs
    monkeypatch.setattr(tr, "compute_logprobs", lambda share, model, **k: calls.append((model, share.batch_size))
                        or real_lp(share, model, **k))
    frozen = {n: {k: v.detach().clone() for k, v in getattr(tr, n).state_dict().items()} for n in ("ref", "teacher")}
    tr.warm_up()
    assert calls == [("policy", 2), ("ref", 2), ("teacher", 2), ("policy", 4), ("ref", 4), ("teacher", 4)]
    for n, state in frozen.items():
        for k, v in getattr(tr, n).state_dict().items():
            assert torch.equal(v, state[k]), f"{n}.{k}: the warm-up moved it"
