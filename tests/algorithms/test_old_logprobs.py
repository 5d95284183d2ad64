"""Trainer.set_old_logprobs on the torch backend: with one epoch and only the ratio reading pi_old,
the no-grad forward leaves out the first mini-batch's rows (0, ``old_from_first_update``): the first
update runs at pi_old's weights, so its own forward's log-probs, detached, are pi_old. The step equals
the step given pi_old of every row; every_row (the KL reward penalty, distillation) and two epochs
compute every row.

Tolerance: the first mini-batch's pi_old is its own forward's in one run and a separate no-grad
forward's in the other, equal in exact arithmetic; only float32 rounding of the two forwards may differ
(rtol 1e-5, atol 1e-6 on weights the step's 3 updates move by ~3e-3). That rounding enters the first
update's ratio and Adam passes it on most where a gradient is near eps, so the trainer runs lr 1e-3 and
eps 1e-6 (as tests/megatron/mt_helpers.trainer_cfg): with ATEN_CPU_CAPABILITY=default the weights differ by
at most 3e-7, on this machine's AVX kernels by 0; at lr 1e-2 and eps 1e-8 the default kernels gave 3e-5.
The Megatron backend's (two DP ranks): tests/megatron/test_old_logprobs_megatron.py."""
import pytest
import torch

from megaforge.build import RunBuilder
from megaforge.config import config_from_dict
from megaforge.data.batch import set_denominators, share_after_first_mini, share_of
from megaforge.types import TrainBatch


def _batch(vocab: int = 512, B: int = 6, T: int = 12) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 10, 5, 11, 8][:B])
    t = torch.arange(T)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(3, vocab, (B, T), generator=g), 0)
    mask = ((t >= 2) & (t < lengths[:, None])).float()
    adv = (torch.randn(B, generator=g)[:, None] * mask).contiguous()
    return set_denominators(TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=adv,
                                       rollout_logprobs=(-5.0 + 0.3 * torch.randn(B, T, generator=g)) * mask))


def _trainer(tiny_model_dir, tokenizer, **trainer):
    cfg = config_from_dict({"model": {"path": tiny_model_dir, "dtype": "float32"}, "max_steps": 2, "seed": 0,
                            "data": {"path": "arithmetic", "format": "synthetic"},
                            "trainer": {"backend": "torch", "device": "cpu", "lr": 1e-3, "eps": 1e-6, "mini_batches": 3,
                                        "micro_batch_size": 2, **trainer}})
    tr = RunBuilder(cfg).trainer(tokenizer)
    seen = []
    compute = tr.compute_logprobs
    tr.compute_logprobs = lambda b, *a, **k: seen.append(b.batch_size) or compute(b, *a, **k)
    return tr, seen


def test_the_rest_of_a_share_is_a_share_of_the_other_mini_batches():
    share = share_of(_batch(), 3, 0, 1)
    rest = share_after_first_mini(share)
    assert rest.is_share and rest.batch_size == 4 and [(p.lo, p.hi) for p in rest.minis] == [(0, 2), (2, 4)]
    assert [(p.size, p.num_tokens, p.num_seqs) for p in rest.minis] == [(p.size, p.num_tokens, p.num_seqs)
                                                                          for p in share.minis[1:]]
    assert torch.equal(rest.tokens, share.tokens[2:, :rest.tokens.shape[1]])


def test_first_mini_batch_takes_pi_old_from_its_update(tiny_model_dir, tokenizer):
    batch = _batch()
    skip, seen_skip = _trainer(tiny_model_dir, tokenizer)
    full, seen_full = _trainer(tiny_model_dir, tokenizer)
    a, b = share_of(batch, 3, 0, 1), share_of(batch, 3, 0, 1)
    skip.set_old_logprobs(a)
    full.set_old_logprobs(b, every_row=True)
    assert seen_skip == [4] and seen_full == [6]  # rows of the no-grad forward: 2 of 3 mini-batches
    assert a.old_from_first_update and not b.old_from_first_update
    assert torch.count_nonzero(a.old_logprobs[:2]) == 0
    torch.testing.assert_close(a.old_logprobs[2:], b.old_logprobs[2:], rtol=1e-5, atol=1e-6)
    ma, mb = skip.train_step(a), full.train_step(b)
    assert ma["updates"] == mb["updates"] == 3.0
    for k in ("loss", "pg_loss", "grad_norm", "entropy", "train_rollout_logprob_abs_diff"):
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-6), k
    for (name, p), q in zip(skip.model.named_parameters(), full.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_every_row_when_pi_old_is_read_beyond_the_ratio_or_over_epochs(tiny_model_dir, tokenizer):
    tr, seen = _trainer(tiny_model_dir, tokenizer, epochs=2)
    share = share_of(_batch(), 3, 0, 1)
    tr.set_old_logprobs(share)  # epoch 2 updates the first mini-batch's rows at moved weights
    assert seen == [6] and not share.old_from_first_update and torch.count_nonzero(share.old_logprobs[:2]) > 0
    with pytest.raises(ValueError, match="trainer.epochs=2"):
        tr.train_step(share.replace(old_from_first_update=True))
    tr, seen = _trainer(tiny_model_dir, tokenizer, mini_batches=1)
    share = share_of(_batch(), 1, 0, 1)
    tr.set_old_logprobs(share)  # one mini-batch: every row (the loop asks for no pi_old then)
    assert seen == [6] and not share.old_from_first_update
