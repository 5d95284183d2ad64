"""The LM head on the trained positions only (megaforge.trainer.causal_lm, trainer.head_positions): the
log-probs, entropy and gradients of the positions with loss_mask > 0 equal those of the full-position
forward, every other position is 0, and model types whose logits are not lm_head(last hidden state)
are refused by name.

Tolerance: float32 on CPU. Both computations run the same decoder call; only the head's matmul
differs in shape ([N, C] vs [B*T, C], C = 64 products per logit, possibly another blocking), so
logits differ by a few ulp; log-softmax / entropy over V = 512 columns and the backward through 2
layers stay within 1e-5 (absolute for log-probs and entropy of magnitude <= 10, relative to each
parameter's largest gradient entry for gradients)."""
import pytest
import torch
from algo_helpers import tiny_torch_trainer
from tests.conftest import make_tiny_model
from test_micro_batch_order import rl_batch

from megaforge.trainer.base import Objective
from megaforge.trainer.causal_lm import causal_lm_logprobs, check_split_head
from megaforge.trainer.logprobs import trained_positions


def _lm(tmp_path, family: str, tie: bool):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(make_tiny_model(str(tmp_path / family), family, tie=tie),
                                                dtype=torch.float32)


def _both(lm, batch, temperature, autocast="off"):
    """(full, selected) of (logprobs, entropy, {name: grad}) for a loss weighting every position."""
    g = torch.Generator().manual_seed(3)
    w_lp, w_ent = torch.randn(batch.tokens.shape, generator=g), torch.randn(batch.tokens.shape, generator=g)
    out = []
    for select in (None, batch.loss_mask):
        lm.zero_grad(set_to_none=True)
        lp, ent = causal_lm_logprobs(lm, batch.tokens, batch.lengths, temperature, True, autocast, select)
        ((lp * w_lp).sum() + (ent * w_ent * batch.loss_mask).sum()).backward()
        out.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}))
    return out


@pytest.mark.parametrize("family,tie,temperature", [("qwen2", True, 1.0), ("llama", False, 0.7), ("qwen3", False, 1.3)])
def test_selected_positions_equal_the_full_forward(tmp_path, family, tie, temperature):
    lm = _lm(tmp_path, family, tie)
    batch = rl_batch()
    (lp, ent, grads), (lp_s, ent_s, grads_s) = _both(lm, batch, temperature)
    on = batch.loss_mask > 0
    assert on.sum() > 50 and (~on & (lp != 0)).any()  # the full forward has values off the mask too
    assert torch.allclose(lp_s[on], lp[on], rtol=0, atol=1e-5)
    assert torch.allclose(ent_s[on], ent[on], rtol=0, atol=1e-5)
    assert (lp_s[~on] == 0).all() and (ent_s[~on] == 0).all()
    # the full forward's gradient with the log-probs off the mask weighted 0 is the selected one's
    lm.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(3)
    w_lp, w_ent = torch.randn(batch.tokens.shape, generator=g), torch.randn(batch.tokens.shape, generator=g)
    lp_f, ent_f = causal_lm_logprobs(lm, batch.tokens, batch.lengths, temperature, True, "off")
    ((lp_f * w_lp * batch.loss_mask).sum() + (ent_f * w_ent * batch.loss_mask).sum()).backward()
    for n, p in lm.named_parameters():
        assert (grads_s[n] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max() + 1e-12, n
    assert any((grads[n] - grads_s[n]).abs().max() > 1e-3 * grads[n].abs().max() for n in grads)  # off-mask weights matter


def test_selected_positions_under_bfloat16_autocast(tmp_path):
    """The decoder in bfloat16 (the same call both ways, so the same hidden states), the head float32."""
    from megaforge.trainer.precision import float32_head

    lm = _lm(tmp_path, "qwen2", False)
    float32_head(lm)
    batch = rl_batch()
    (lp, ent, _), (lp_s, ent_s, _) = _both(lm, batch, 1.0, "bfloat16")
    on = batch.loss_mask > 0
    assert lp_s.dtype == torch.float32
    assert torch.allclose(lp_s[on], lp[on], rtol=0, atol=1e-5) and torch.allclose(ent_s[on], ent[on], rtol=0, atol=1e-5)


def test_trained_positions_are_the_masked_ones_past_t0():
    mask = torch.tensor([[1.0, 1, 0, 1, 1], [0, 0, 1, 1, 0]])
    rows, cols = trained_positions(mask, torch.tensor([4, 5]))
    assert list(zip(rows.tolist(), cols.tolist())) == [(0, 1), (0, 3), (1, 2), (1, 3)]  # not t = 0, not t >= length


def test_other_model_types_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match=r"model is 'gpt2' \(GPT2LMHeadModel\): set trainer.head_positions: all"):
        check_split_head(gpt2)


def _trainer(*extra):
    return tiny_torch_trainer("--trainer.micro_batch_size", "4", "--grpo.beta", "0.1", *extra)


def test_trainer_logprobs_and_gradients_of_both_modes():
    batch = rl_batch()
    on = batch.loss_mask > 0
    sel, full = _trainer(), _trainer("--trainer.head_positions", "all")
    lp_all = sel.compute_logprobs(batch)
    assert torch.equal(full.compute_logprobs(batch), lp_all)  # the default computes every position
    lp_tr = sel.compute_logprobs(batch, positions="trained")
    assert torch.allclose(lp_tr[on], lp_all[on], rtol=0, atol=1e-5) and (lp_tr[~on] == 0).all()
    assert torch.equal(full.compute_logprobs(batch, positions="trained"), lp_all * on)  # masked: the same numbers
    with pytest.raises(ValueError, match=r"positions must be one of \('all', 'trained'\), got 'response'"):
        sel.compute_logprobs(batch, positions="response")
    grads, metrics = [], []
    for tr in (sel, full):
        rl = Objective(tr.temperature, entropy=True, packed=False, loss=tr._policy_loss, trained_positions=True)
        metrics.append({k: float(v) for k, v in tr._forward_backward(batch, rl).items()})
        grads.append({n: p.grad.clone() for n, p in tr.model.named_parameters()})
    for n, g in grads[1].items():
        assert (grads[0][n] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-12, n
    for k, v in metrics[1].items():  # entropy, kl, clip_frac, ...: sums over the trained tokens
        assert metrics[0][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
