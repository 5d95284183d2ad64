"""The PPO critic: clipped value loss by hand, and the torch backend's value model (alignment,
training, checkpoint round trip)."""
import pytest
import torch
from algo_helpers import ROOT, padded_batch

from megaforge.algorithms import clipped_value_loss, value_objective
from megaforge.build import RunBuilder

# Tolerances: the hand-computed losses are float32 on exact binary fractions (0.5, 0.125, 1.805 within
# 1 ulp): torch.allclose / pytest.approx defaults (rtol 1e-5 / rel 1e-6) are >= 8 ulp. The value model
# check compares the same HF backbone run batched (padded rows) and per row: float32 sums of 64-128
# terms in another order, <= ~1e-6 on |V| <= 1; atol 1e-5 (+ rtol 1e-5) is 10x that.


def test_clipped_value_loss_hand_computed():
    v = torch.tensor([[1.0, 0.5, 2.0]], requires_grad=True)
    old = torch.tensor([[0.8, 0.5, 1.0]])
    ret = torch.tensor([[0.0, 1.0, 3.0]])
    mask = torch.ones(1, 3)
    loss, st = clipped_value_loss(v, old, ret, mask, value_clip=0.1)
    # token 0: V 1.0, V_clip 0.9 -> max(1.0, 0.81) / 2; token 1: no move; token 2: V 2.0, V_clip 1.1
    # -> max(1.0, 3.61) / 2 = 1.805 (the clipped error is larger: that term has no gradient wrt V)
    assert torch.allclose(loss, torch.tensor([[0.5, 0.125, 1.805]]))
    assert st["vf_clip_frac"].tolist() == [[0.0, 0.0, 1.0]]
    (g,) = torch.autograd.grad(loss.sum(), v)
    assert torch.allclose(g, torch.tensor([[1.0, -0.5, 0.0]]))
    unclipped, _ = clipped_value_loss(v, old, ret, mask, value_clip=None)
    assert torch.allclose(unclipped, torch.tensor([[0.5, 0.125, 0.5]]))
    total, m = value_objective(v, old, ret, torch.tensor([[1.0, 1.0, 0.0]]), num_tokens=4, value_clip=0.1)
    assert float(total.detach()) == pytest.approx((0.5 + 0.125) / 4)
    assert float(m["critic/loss"]) == pytest.approx((0.5 + 0.125) / 4)


@pytest.fixture(scope="module")
def trainer():
    from megaforge.config import load_config
    from megaforge.hf import load_tokenizer
    from megaforge.trainer.torch_backend import TorchTrainer

    cfg = load_config(["--config", f"{ROOT}/configs/demo_cpu.yaml", "--model.config", f"{ROOT}/configs/models/tiny-qwen2",
                       "--model.tokenizer", f"{ROOT}/assets/tiny-tokenizer", "--algo.advantage", "gae",
                       "--critic.lr", "1e-3", "--trainer.device", "cpu", "--trainer.micro_batch_size", "2",
                       "--trainer.mini_batches", "2"])
    t = TorchTrainer(RunBuilder(cfg).trainer_spec(), load_tokenizer(cfg.model))
    t.init_critic()
    return t


def _batch():
    return padded_batch()


def test_values_are_token_aligned(trainer):
    c = trainer.critic
    with torch.no_grad():
        c.net.head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))  # not the global RNG: the
        # module's later tests start from this head whatever ran before them
        c.net.head.bias.fill_(0.3)
    batch = _batch()
    v = trainer.compute_values(batch)
    assert v.shape == (4, 9)
    assert torch.all(v[:, 0] == 0)
    for b, n in enumerate(batch.lengths.tolist()):
        assert torch.all(v[b, n:] == 0)
        # V at token t is the head on the hidden state of position t - 1, from this row alone
        with torch.no_grad():
            h = c.net.backbone(input_ids=batch.tokens[b:b + 1, :n], use_cache=False).last_hidden_state
            ref = c.net.head(h).squeeze(-1)[0, :-1]
        assert torch.allclose(v[b, 1:n], ref, atol=1e-5)


def test_critic_learns_returns_and_round_trips(trainer, tmp_path):
    batch = _batch()
    target = torch.linspace(-1, 1, 9).expand(4, 9) * batch.loss_mask
    losses = []
    for _ in range(12):
        batch.values = trainer.compute_values(batch)
        batch.returns = target
        m = trainer.train_critic(batch)
        losses.append(m["critic/loss"])
    assert all(k in m for k in ("critic/grad_norm", "critic/vf_clip_frac", "critic/values"))
    assert losses[-1] < 0.5 * losses[0]
    # value clipping engages in the trainer: after one update with V_old kept stale, values that
    # moved past V_old +- value_clip are clipped (the exact semantics are tested by hand above)
    trainer.cfg.critic.value_clip = 1e-4
    batch.values = trainer.compute_values(batch)
    batch.returns = batch.values + 10.0 * batch.loss_mask
    trainer.cfg.trainer.mini_batches = 1
    first = trainer.train_critic(batch)
    second = trainer.train_critic(batch)
    assert first["critic/vf_clip_frac"] == 0.0 and second["critic/vf_clip_frac"] > 0.3
    trainer.cfg.critic.value_clip, trainer.cfg.trainer.mini_batches = 0.2, 2
    # the critic is part of the trainer checkpoint
    trainer.save(str(tmp_path / "ck"))
    v = trainer.compute_values(batch)
    with torch.no_grad():
        trainer.critic.net.head.bias.add_(1.0)
    trainer.load(str(tmp_path / "ck"))
    assert torch.equal(trainer.compute_values(batch), v)
    assert trainer.critic.steps == 2 * 12 + 2  # two mini-batches per train_step, then two of one
