"""The torch backend cuts micro-batches from the rows ordered by length (megaforge.trainer.torch_ddp):
gradients and metrics equal those of the whole mini-batch in one micro-batch for every loss and
aggregation, per-row results come back in the rows' order, and the computed positions fall."""
import pytest
import torch
from algo_helpers import rl_batch as _rl_batch
from algo_helpers import tiny_torch_trainer as _trainer

from megaforge.trainer import torch_ddp
from megaforge.trainer.base import Objective
from megaforge.trainer.causal_lm import causal_lm_logprobs


def rl_batch(B: int = 9, seed: int = 0):
    return _rl_batch(B, seed)


def test_length_ordered_is_a_permutation_in_runs_of_size_longest_first():
    lengths = torch.tensor([7, 3, 9, 3, 12, 1, 9])
    index = torch_ddp.length_ordered(lengths, 3)
    assert [len(i) for i in index] == [3, 3, 1]
    assert torch.cat(index).tolist() == [4, 2, 6, 0, 1, 3, 5]  # stable: equal lengths keep their order
    assert torch_ddp.padded_tokens(lengths, index) == 3 * 12 + 3 * 7 + 1 * 1
    assert torch_ddp.length_ordered(torch.zeros(0, dtype=torch.long), 4) == []


def test_token_budget_runs_cut_in_order_within_both_limits():
    from megaforge.data.batch import token_budget_runs

    assert token_budget_runs([300, 500, 200, 900, 100], 8, 1000) == [(0, 3), (3, 5)]
    assert token_budget_runs([300, 500, 200, 900, 100], 2, 1000) == [(0, 2), (2, 3), (3, 5)]
    assert token_budget_runs([300, 500, 200, 900, 100], 8, 1000, padded=True) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert token_budget_runs([2000, 5, 5], 8, 1000) == [(0, 1), (1, 3)]  # a row over the budget: alone
    assert token_budget_runs(list(range(7)), 3) == [(0, 3), (3, 6), (6, 7)]  # budget 0: rows only
    assert token_budget_runs([], 4, 10) == []
    g = torch.Generator().manual_seed(1)
    for padded in (False, True):
        lengths = torch.randint(1, 300, (200,), generator=g).tolist()
        runs = token_budget_runs(lengths, 16, 1024, padded)
        assert [a for a, _ in runs] == [0] + [b for _, b in runs[:-1]] and runs[-1][1] == 200  # in order, all rows
        for a, b in runs:
            cost = (b - a) * max(lengths[a:b]) if padded else sum(lengths[a:b])
            assert b - a <= 16 and (cost <= 1024 or b - a == 1)
        # greedy: the next row would have broken a limit
        for (a, b), _ in zip(runs, runs[1:]):
            nxt = (b - a + 1) * max(lengths[a:b + 1]) if padded else sum(lengths[a:b + 1])
            assert b - a == 16 or nxt > 1024
    with pytest.raises(ValueError, match="rows 0, tokens 5"):
        token_budget_runs([1], 0, 5)


def test_length_ordered_with_a_token_budget():
    lengths = torch.tensor([7, 3, 9, 3, 12, 1, 9])
    index = torch_ddp.length_ordered(lengths, 3, tokens=20)  # sorted 12, 9, 9, 7, 3, 3, 1
    assert [i.tolist() for i in index] == [[4], [2, 6], [0, 1], [3, 5]]
    assert all(len(i) * int(lengths[i].max()) <= 20 for i in index)


def test_gsm8k_shaped_mini_batch_computes_fewer_positions(capsys):
    """One mini-batch of the GSM8K run (512 rows / 4 mini-batches = 128, micro_batch_size 16): prompts
    of 100-320 tokens, responses of 50-512 (mean ~280), so rows of ~150-830 tokens."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 321, (128,), generator=g)
    response = (280 + 120 * torch.randn(128, generator=g)).round().long().clamp(50, 512)
    lengths = prompt + response
    row_order = list(torch.arange(128).split(16))
    before = torch_ddp.padded_tokens(lengths, row_order)
    after = torch_ddp.padded_tokens(lengths, torch_ddp.length_ordered(lengths, 16))
    real = int(lengths.sum())
    with capsys.disabled():
        print(f"\nGSM8K-shaped mini-batch: {real} real tokens (rows {int(lengths.min())}-{int(lengths.max())}); "
              f"positions computed: row order {before} ({before / real:.2f}x), length order {after} ({after / real:.2f}x)")
    assert after < before
    assert after <= 1.1 * real  # sorted runs of 16 of 128 rows: each pads to its own longest only


@pytest.mark.parametrize("extra", [
    ["--algo.loss", "ppo_clip", "--algo.clip_c", "3", "--grpo.beta", "0.1", "--algo.entropy_coef", "0.01",
     "--algo.tis_cap", "2", "--algo.tis_level", "sequence"],
    ["--algo.loss", "gspo"],
    ["--algo.loss", "cispo", "--algo.loss_agg", "seq_mean_token_sum"],
    ["--algo.loss", "sapo", "--algo.mis_threshold", "1.05", "--algo.mis_level", "geometric"],
    ["--algo.loss", "reinforce", "--algo.loss_agg", "seq_mean_token_sum_norm", "--algo.loss_agg_norm", "16",
     "--algo.mis_threshold", "3", "--algo.mis_level", "sequence"],
], ids=["ppo_token_mean", "gspo_seq_mean_token_mean", "cispo_seq_sum", "sapo_geometric_mis", "reinforce_norm"])
def test_gradient_and_metrics_equal_one_micro_batch(extra):
    """3-row length-ordered micro-batches of 9 rows vs the 9 rows as one micro-batch. Tolerance: float32,
    the same per-token terms summed in another order (~150 tokens into each gradient entry through 2
    layers and the head: ~1e-6 relative); 1e-4 of each parameter's largest gradient entry leaves
    room for CPU kinds, and a denominator taken per micro-batch (a factor >= 1.3) fails it."""
    batch = rl_batch()
    grads, metrics = [], []
    for mbs in (3, 9):
        tr = _trainer("--trainer.micro_batch_size", str(mbs), *extra)
        rl = Objective(tr.temperature, entropy=True, packed=False, loss=tr._policy_loss, trained_positions=True)
        metrics.append({k: float(v) for k, v in tr._forward_backward(batch, rl).items()})
        grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters()})
    for n, g in grads[1].items():
        assert (grads[0][n] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-12, n
    assert metrics[0].keys() == metrics[1].keys()
    for k, v in metrics[1].items():  # each a sum of ~150 float32 token contributions
        assert metrics[0][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_a_token_budget_keeps_gradients_metrics_and_row_order():
    """trainer.micro_batch_tokens 40 (micro-batches of 1-4 rows of 5-20 tokens, padded to their
    longest) vs the 9 rows in one micro-batch: same gradients and metrics (tolerance as above), and
    log-probs in the batch's row order equal to one micro-batch's within 1e-5 (float32, padding only
    differs)."""
    batch = rl_batch()
    extra = ["--algo.loss", "ppo_clip", "--grpo.beta", "0.1", "--algo.entropy_coef", "0.01"]
    out = []
    for flags in (["--trainer.micro_batch_size", "9"],
                  ["--trainer.micro_batch_size", "9", "--trainer.micro_batch_tokens", "40"]):
        tr = _trainer(*flags, *extra)
        rl = Objective(tr.temperature, entropy=True, packed=False, loss=tr._policy_loss, trained_positions=True)
        metrics = {k: float(v) for k, v in tr._forward_backward(batch, rl).items()}
        grads = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
        out.append((metrics, grads, tr.compute_logprobs(batch)))
    runs = torch_ddp.length_ordered(batch.lengths, 9, tokens=40)
    assert len(runs) > 2  # the budget did cut
    (m0, g0, lp0), (m1, g1, lp1) = out
    for n, g in g0.items():
        assert (g1[n] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-12, n
    for k, v in m0.items():
        assert m1[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert (lp1 - lp0).abs().max() <= 1e-5


def test_logprobs_and_values_come_back_in_row_order():
    """One row per micro-batch: each row's forward is the very computation of a per-row forward, so the
    results are equal to the bit in the batch's row order (rows of other lengths would not fit).
    Three rows per micro-batch: padded to the micro-batch's longest row; float32, 2 layers, ~20
    positions of attention: 1e-5."""
    batch = rl_batch()
    tr = _trainer("--trainer.micro_batch_size", "1", "--algo.advantage", "gae")
    tr.init_critic()
    with torch.no_grad():
        tr.critic.net.head.weight.normal_(0, 0.1)
        per_row_lp = torch.zeros_like(batch.old_logprobs)
        per_row_v = torch.zeros_like(batch.old_logprobs)
        for b, n in enumerate(batch.lengths.tolist()):
            tok, ln = batch.tokens[b:b + 1, :n], batch.lengths[b:b + 1]
            per_row_lp[b, :n] = causal_lm_logprobs(tr.model, tok, ln, 0.8, False, "off")[0][0]
            per_row_v[b, :n] = tr.critic.net(tok, ln)[0]
    assert torch.equal(tr.compute_logprobs(batch), per_row_lp)
    assert torch.equal(tr.compute_values(batch), per_row_v)
    tr.cfg.trainer.micro_batch_size = 3
    assert torch.allclose(tr.compute_logprobs(batch), per_row_lp, rtol=0, atol=1e-5)
    assert torch.allclose(tr.compute_values(batch), per_row_v, rtol=0, atol=1e-5)
