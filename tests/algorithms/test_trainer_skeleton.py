"""The training skeleton of megaforge.trainer.base on the torch backend: the optimizer is built once
and ``reset_optimizer`` (each phase's start) makes it fresh; the reference is chosen by name.

Tolerance: none. The two trainers run the same float32 ops in the same order on the same inputs in one
process, so their weights and metrics are equal to the bit (not a rounding claim across machines)."""
import pytest
import torch

from megaforge.config import config_from_dict
from megaforge.build import RunBuilder
from megaforge.types import TrainBatch


def _batch(vocab: int = 512, B: int = 4, T: int = 12) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 10, 5][:B])
    t = torch.arange(T)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(3, vocab, (B, T), generator=g), 0)
    mask = ((t >= 2) & (t < lengths[:, None])).float()
    adv = (torch.randn(B, generator=g)[:, None] * mask).contiguous()
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=adv,
                      rollout_logprobs=(-5.0 + 0.3 * torch.randn(B, T, generator=g)) * mask,
                      num_tokens=int(mask.sum()), num_seqs=int((mask.sum(-1) > 0).sum()))


@pytest.fixture
def cfg(tiny_model_dir):
    return config_from_dict({"model": {"path": tiny_model_dir, "dtype": "float32"}, "max_steps": 2, "seed": 0,
                             "data": {"path": "arithmetic", "format": "synthetic"},
                             "trainer": {"backend": "torch", "device": "cpu", "lr": 1e-2, "mini_batches": 2}})


def test_reset_optimizer_keeps_the_optimizer_and_makes_it_fresh(cfg, tokenizer):
    a, b = RunBuilder(cfg).trainer(tokenizer), RunBuilder(cfg).trainer(tokenizer)
    opt, batch = a.opt, _batch()
    a.train_step(batch)  # two optimizer steps: Adam moments and step counts
    assert a.opt.state and a.version == 2 and a.sched["step"] == 2
    a.reset_optimizer(1e-2, 6, 2, "linear")
    assert a.opt is opt and not a.opt.state and a.sched["step"] == 0 and a.version == 2
    b.model.load_state_dict(a.model.state_dict())  # a fresh trainer at a's weights
    b.reset_optimizer(1e-2, 6, 2, "linear")
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma == mb and ma["lr"] == pytest.approx(0.75e-2)  # warm-up steps 0 and 1 (lr/2, lr): the schedule restarted
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name


def test_empty_mini_batch_takes_no_step_and_reference_is_chosen_by_name(cfg, tokenizer):
    tr = RunBuilder(cfg).trainer(tokenizer)
    batch = _batch()
    batch.loss_mask[:2] = 0.0  # the first mini-batch (rows 0-1) has no trained token
    before = [p.detach().clone() for p in tr.model.parameters()]
    m = tr.train_step(batch)
    assert m["empty_minibatches"] == 1.0 and tr.version == 1 and tr.sched["step"] == 1
    assert any(not torch.equal(p, q) for p, q in zip(tr.model.parameters(), before))
    with pytest.raises(RuntimeError, match=r"no reference model \(snapshot_reference not called\)"):
        tr.compute_logprobs(batch, model="ref")
    with pytest.raises(ValueError, match=r"model must be 'policy', 'ref' or 'teacher', got 'critic'"):
        tr.compute_logprobs(batch, model="critic")
    tr.snapshot_reference()
    assert torch.equal(tr.compute_logprobs(batch, model="ref"), tr.compute_logprobs(batch))
    with pytest.raises(RuntimeError, match=r"compute_values: no critic \(init_critic not called"):
        tr.compute_values(batch)
