"""Advantage estimators on data-parallel shares of a batch (AdvantageInputs.share), in one process:
each share runs in its own thread and the shares' sums / maxima are added up in-process, so every
share's advantages can be compared with the whole batch's computation. The shares are the rows the
hand-off gives each DP rank (megaforge.data.batch.share_rows), trimmed to their longest row, with
groups spanning shares."""
import threading

import pytest
import torch

from megaforge.algorithms import ADVANTAGES, AdvantageInputs, Share, value_targets
from megaforge.algorithms.advantages import whiten
from megaforge.algorithms.params import ObjectiveParams
from megaforge.data.batch import share_rows

B, T, MINI_BATCHES = 12, 7, 2


class InProcessShares:
    """Shares of a batch (``rows``: each one's rows of it) run in one thread each; each reduction call
    waits for every share's partial and gives every share their sum (in share order) / maximum."""

    def __init__(self, rows: list[torch.Tensor]):
        self.rows, self.k = rows, len(rows)
        self.parts, self.barrier, self.calls = [None] * self.k, threading.Barrier(self.k, timeout=30), 0

    def reducer(self, i: int, combine):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[i] = t.clone()
            self.barrier.wait()
            out = combine(torch.stack(self.parts))
            if i == 0:
                self.calls += 1
            self.barrier.wait()  # nobody overwrites a part before every share has read them
            return out

        return reduce

    def run(self, fn, inputs_of):
        """``fn(inputs_of(i, share_i))`` of every share i, in threads; the results in share order."""
        out, errors = [None] * self.k, []

        def one(i):
            try:
                out[i] = fn(inputs_of(i, Share(self.rows[i], self.reducer(i, lambda p: p.sum(0)),
                                               self.reducer(i, lambda p: p.amax(0)))))
            except Exception as e:  # noqa: BLE001  (re-raised in the test's thread)
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(self.k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def batch(seed: int = 0):
    """rewards [B] (0/1/2) in groups of 4 consecutive rows, a right-padded loss mask of varied lengths
    (row 5 trains nothing), token rewards, values and the student's / a teacher's log-probs [B, T] (float32)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[5] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    mask[:, 0] = 0.0  # a prompt token
    return dict(rewards=torch.randint(0, 3, (B,), generator=g).float(), group_ids=torch.arange(B) // 4,
                loss_mask=mask, token_rewards=0.1 * torch.randn(B, T, generator=g) * mask,
                values=torch.randn(B, T, generator=g) * mask,
                logprobs=-torch.rand(B, T, generator=g) * mask, teacher_logprobs=-torch.rand(B, T, generator=g) * mask)


def split(d: dict, dp: int):
    """The whole-batch inputs ``d`` as the dp shares' rows (each trimmed to its last trained column)."""
    rows = [torch.tensor(share_rows(B, MINI_BATCHES, r, dp)) for r in range(dp)]
    shares = InProcessShares(rows)

    def inputs_of(i, share):
        m = d["loss_mask"][rows[i]]
        cols = int(m.nonzero()[:, 1].max()) + 1 if m.any() else 1
        return AdvantageInputs(d["rewards"], d["group_ids"], m[:, :cols], d["token_rewards"][rows[i], :cols],
                               d["values"][rows[i], :cols], share=share, logprobs=d["logprobs"][rows[i], :cols],
                               teacher_logprobs=d["teacher_logprobs"][rows[i], :cols])

    return shares, rows, inputs_of


def params():
    return ObjectiveParams(std_eps=1e-6, gamma=0.9, lam=0.8)


def test_shares_split_groups():
    """The point of the whole-batch group statistics: a share holds parts of groups."""
    for dp in (2, 4):
        rows = [share_rows(B, MINI_BATCHES, r, dp) for r in range(dp)]
        groups = [{i // 4 for i in rs} for rs in rows]
        assert any(groups[a] & groups[b] for a in range(dp) for b in range(a + 1, dp)), dp


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("name", list(ADVANTAGES.names()))
def test_every_estimator_on_shares_equals_the_whole_batch(name, dp):
    """Every registered estimator declares shares=True and, on every share, gives the whole batch's
    advantages of its rows (and gae its returns). Sequence-level estimators compute the same float64
    group statistics from the same [B] rewards: exact. Token-level ones add the shares' float64 partials
    of 35 trained tokens in another order (~1e-15 relative) before the float32 cast: rtol 2.5e-7 (2 ulps),
    atol 1e-7 for values near 0."""
    assert ADVANTAGES.declared(name).get("shares") is True, name
    fn, p, d = ADVANTAGES.get(name), params(), batch()
    whole = fn(AdvantageInputs(**d), p)
    shares, rows, inputs_of = split(d, dp)
    got = shares.run(lambda inp: (fn(inp, p), value_targets(inp, p)), inputs_of)
    targets = value_targets(AdvantageInputs(**d), p)
    for (adv, ret), r in zip(got, rows):
        cols = adv.shape[1]
        assert torch.equal(whole[r, cols:], torch.zeros_like(whole[r, cols:]))  # trimmed columns: untrained
        if name in ("grpo", "dr_grpo", "rloo"):
            assert torch.equal(adv, whole[r, :cols]), name
        else:
            torch.testing.assert_close(adv, whole[r, :cols], rtol=2.5e-7, atol=1e-7)
        # the critic's targets are per row: the same float32 operations on the same values
        torch.testing.assert_close(ret, targets[r, :cols], rtol=2.5e-7, atol=1e-7)
    # whitening: (-min, max), (count, sum), the centred sum of squares; group statistics need none
    assert shares.calls == (3 if name in ("reinforce_pp", "reinforce_pp_baseline", "gae") else 0)


def test_whitening_equality_is_decided_over_the_whole_batch():
    """Each share's trained values are all equal but the shares' differ: the batch is whitened (a
    share deciding alone would give 0); all equal over the batch: exactly 0 everywhere, with eps 0."""
    x = torch.tensor([[1.0, 1.0], [1.0, 0.0], [3.0, 3.0], [3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    rows = [torch.tensor([0, 1]), torch.tensor([2, 3])]

    def whitened(values):
        shares = InProcessShares(rows)
        return torch.cat(shares.run(
            lambda inp: whiten(values[inp.share.rows], inp.loss_mask, 0.0, inp.batch_sum, inp.batch_max),
            lambda i, s: AdvantageInputs(torch.zeros(4), torch.arange(4), mask[rows[i]], share=s)))

    # 3 ones and 4 threes: mean 15/7, population variance 48/49 -> 1: -2/sqrt(3), 3: sqrt(3)/2
    lo, hi = -2 / 3 ** 0.5, 3 ** 0.5 / 2
    want = torch.tensor([[lo, lo], [lo, 0.0], [hi, hi], [hi, hi]])
    torch.testing.assert_close(whitened(x), want, rtol=2.5e-7, atol=1e-7)  # float64 arithmetic, float32 cast
    assert torch.equal(whitened(torch.full((4, 2), 0.1)), torch.zeros(4, 2))


def test_a_share_without_trained_tokens_takes_part():
    """Share 0 trains nothing (its maximum is -inf, its count 0); share 1's values are whitened over
    the batch, which is share 1 alone."""
    x = torch.tensor([[5.0, 7.0], [0.0, 0.0], [1.0, 2.0], [4.0, 0.0]])
    mask = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    rows = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    shares = InProcessShares(rows)
    got = shares.run(lambda inp: whiten(x[inp.share.rows], inp.loss_mask, 0.0, inp.batch_sum, inp.batch_max),
                     lambda i, s: AdvantageInputs(torch.zeros(4), torch.arange(4), mask[rows[i]], share=s))
    assert torch.equal(got[0], torch.zeros(2, 2))
    torch.testing.assert_close(got[1], whiten(x[2:], mask[2:], 0.0), rtol=2.5e-7, atol=1e-7)


def test_inputs_name_what_does_not_fit():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"loss_mask has 2 rows, the rows held are share.rows \(3,\)"):
        AdvantageInputs(torch.zeros(4), torch.zeros(4), mask, share=Share(torch.arange(3), sum, max))
    with pytest.raises(ValueError, match="loss_mask has 2 rows, the rows held are B = 4"):
        AdvantageInputs(torch.zeros(4), torch.zeros(4), mask)
    with pytest.raises(ValueError, match=r"rewards \(4,\) and group_ids \(3,\) must both be \[B\]"):
        AdvantageInputs(torch.zeros(4), torch.zeros(3), mask)
    with pytest.raises(ValueError, match=r"AdvantageInputs.values: shape \(2, 2\), loss_mask \(2, 3\)"):
        AdvantageInputs(torch.zeros(2), torch.zeros(2), mask, values=torch.zeros(2, 2))
