"""Step metrics as values (issue 42 point 5): micro-batch statistics declare their reduction
(megaforge.algorithms.stats), stay on the device across micro-batches and updates, and are reduced
over ranks and copied to the host once per trainer call (megaforge.trainer.metrics).

Device reads are counted on the CPU by :class:`device_reads.DeviceReads` (what would each be a device
sync on a GPU: a host read of a value computed from the model or from the uploaded batch)."""
import pytest
import torch
from algo_helpers import rl_batch
from algo_helpers import tiny_torch_trainer as _trainer
from device_reads import DeviceReads

from megaforge.algorithms import policy_objective
from megaforge.algorithms.stats import MAX, SUM, Stat, contribution, largest, merge, token_mean
from megaforge.trainer.base import Objective
from megaforge.trainer.metrics import COUNT, MEAN, StepMetrics, stack_and_reduce, world_stats_to_host


# ------------------------------------------------------------------------------------ the values
def test_stats_merge_by_their_declared_reduction():
    a = {"loss": contribution(torch.tensor(0.25)), "ratio_max": largest(torch.tensor(1.5))}
    b = {"loss": contribution(torch.tensor(0.5)), "ratio_max": largest(torch.tensor(1.25)),
         "kl": token_mean(torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 0.0]]), 4)}
    m = merge(merge(None, a), b)
    assert {k: (float(v), v.reduce) for k, v in m.items()} == {
        "loss": (0.75, SUM), "ratio_max": (1.5, MAX), "kl": (0.25, SUM)}
    assert all(v.value.dtype == torch.float64 for v in m.values())
    with pytest.raises(ValueError, match="metric 'loss': reduction 'max' after 'sum'"):
        merge(m, {"loss": largest(torch.tensor(1.0))})
    with pytest.raises(ValueError, match="Stat.reduce must be one of"):
        Stat(torch.tensor(1.0), "mean")
    with pytest.raises(ValueError, match="0-d tensor"):
        Stat(torch.ones(2))


def test_one_collective_per_reduction_kind_sums_averaged_over_updates():
    stats = {"b": Stat(torch.tensor(6.0, dtype=torch.float64)), "a": Stat(torch.tensor(2.0, dtype=torch.float64), MAX),
             "c": Stat(torch.tensor(3.0, dtype=torch.float64))}
    calls = []

    def reduce(vec, op):  # two ranks holding the same values
        calls.append((op, vec.tolist()))
        return vec * 2 if op == "sum" else vec

    keys, vec = stack_and_reduce(stats, 3, reduce)
    assert calls == [("sum", [6.0, 3.0]), ("max", [2.0])]
    assert keys == ["a", "b", "c"] and vec.tolist() == [2.0, 4.0, 2.0]
    acc = StepMetrics()
    acc.add_stats(stats)
    acc.add_values({"grad_norm": (1.0, MEAN), "skipped": (1.0, COUNT)})
    acc.add_stats({})
    acc.add_values({"grad_norm": (3.0, MEAN), "skipped": (0.0, COUNT)})
    out = acc.result(acc.start_to_host(lambda s, u: world_stats_to_host(s, u, lambda v, op: v)))
    assert out == {"a": 2.0, "b": 3.0, "c": 1.5, "grad_norm": 2.0, "skipped": 1.0, "updates": 2.0,
                   "empty_minibatches": 0.0}


# ------------------------------------------------------------------------- reads of the device
def _reads(tr, call, batch) -> DeviceReads:
    nets = [tr.model] + ([tr.critic.net] if tr.critic is not None else [])
    with DeviceReads([p for net in nets for p in net.parameters()]) as reads:
        call(batch)
    return reads


@pytest.mark.parametrize("kind", ["rl", "rl_critic", "sft"])
def test_a_step_reads_the_device_once_per_update_and_once_for_its_metrics(kind):
    """8 rows, 2 mini-batches: 1, 2 or 4 micro-batches each. megaforge's own reads are the gradient
    norm of every update (its finite check decides the step) and one copy of the stacked metrics per
    trainer call (the policy's, the critic's), whatever the number of micro-batches. Before: one copy
    per metric and micro-batch, one nonzero per micro-batch, one read per metric and update of the
    copied sums and the norms (megaforge's reads for "rl": 32 at 1 micro-batch per update, 80 at 4).
    Not counted here: transformers' SDPA mask builder reads the padding mask in every forward (its
    is_causal shortcut: 1 read without padding, 2 with), outside megaforge."""
    batch = rl_batch()
    extra = {"rl": ["--grpo.beta", "0.1"], "rl_critic": ["--algo.advantage", "gae"], "sft": []}[kind]
    counts = []
    for mbs in (4, 2, 1):
        tr = _trainer("--trainer.micro_batch_size", str(mbs), "--trainer.mini_batches", "2", *extra)
        if kind == "rl_critic":
            tr.init_critic()
            batch.values, batch.returns = torch.zeros_like(batch.loss_mask), 0.5 * batch.loss_mask
        reads = _reads(tr, tr.sft_step if kind == "sft" else tr.train_step, batch)
        counts.append(reads.count_from("megaforge"))
    calls = 2 if kind == "rl_critic" else 1
    assert counts == [calls * (2 + 1)] * 3, counts


# ------------------------------------------------------------------------------- the same values
def test_two_micro_batch_updates_give_the_metrics_of_the_formulas():
    """2 mini-batches of 4 rows, 2 micro-batches each. Expected: per update, policy_objective on the
    whole mini-batch with the log-probs and entropy of the model before that update (one forward of
    the 4 rows), then the mean of the two updates; grad_norm and lr of a by-hand replay of the same
    updates (the same code: equal to the bit). Tolerance rel 1e-5: float32 forwards of the
    micro-batches (padded to their own longest row) against one forward of the mini-batch, ~50
    token terms per metric; a metric summed over one micro-batch only would be off by ~50%."""
    batch = rl_batch()
    args = ("--trainer.micro_batch_size", "2", "--trainer.mini_batches", "2", "--grpo.beta", "0.1",
            "--algo.entropy_coef", "0.01")
    tr, hand = _trainer(*args), _trainer(*args)
    m = tr.train_step(batch)
    rl = Objective(hand.temperature, entropy=True, packed=False, loss=hand._policy_loss, trained_positions=True)
    expected, norms, lrs = [], [], []
    for mini in hand._mini_batches(batch):
        with torch.no_grad():
            lp, ent = hand._logprobs(hand.module, mini, hand.temperature, True, True)
            _, stats = policy_objective(lp, mini, hand.params, ent)
        expected.append({k: float(v) for k, v in stats.items()})
        hand._forward_backward(mini, rl)
        step = hand._optimizer_step()
        norms.append(step["grad_norm"][0])
        lrs.append(step["lr"][0])
    assert set(m) == set(expected[0]) | {"grad_norm", "lr", "skipped", "updates", "empty_minibatches"}
    for k in expected[0]:
        want = (expected[0][k] + expected[1][k]) / 2
        assert m[k] == pytest.approx(want, rel=1e-5, abs=1e-7), k
    assert m["grad_norm"] == sum(norms) / 2 and m["lr"] == sum(lrs) / 2
    assert (m["skipped"], m["updates"], m["empty_minibatches"]) == (0.0, 2.0, 0.0)
