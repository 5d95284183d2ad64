"""The torch layer spec's packed (thd) attention (megaforge.trainer.megatron.layers.SDPAttention):
the documents of a micro-batch attended in one padded SDPA call equal each document attended alone
(causal, GQA), forward and backward. Tolerance: float32 on CPU; both sides run the same SDPA math on
the same rows, the padded call adds only zero-weight padded keys after each document (exp(-inf) = 0)
and another blocking of the same sums: 1e-5 absolute on outputs and gradients of magnitude ~1."""
import math

import pytest
import torch
import torch.nn.functional as F

from megaforge.trainer.megatron.layers import SDPAttention, padded_index


def _attention(np_: int, hn: int) -> SDPAttention:
    att = SDPAttention.__new__(SDPAttention)  # the core attention alone, without megatron's parallel state
    torch.nn.Module.__init__(att)
    att.cp_group, att.np, att.hn, att.scale, att.dropout = None, np_, hn, 1 / math.sqrt(hn), 0.0
    return att


def _per_document(q, k, v, docs, scale):
    outs = []
    for lo, hi in docs:
        qi, ki, vi = (x[lo:hi, 0].transpose(0, 1)[None] for x in (q, k, v))  # [1, h, n, hn]
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)[:, None]  # [t, 1, np, hn]


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [7, 7], [1, 1, 1], [12]])
def test_one_padded_call_equals_each_document_alone(lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    t, np_, ng, hn = sum(lengths), 4, 2, 8
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    docs = list(zip(cu[:-1], cu[1:]))
    leaves = [torch.randn(t, 1, h, hn, generator=g, requires_grad=True) for h in (np_, ng, ng)]
    w = torch.randn(t, 1, np_, hn, generator=g)
    att = _attention(np_, hn)
    got = att._attend(*leaves, docs)
    (got * w).sum().backward()
    grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    want = _per_document(*leaves, docs, att.scale)
    (want * w).sum().backward()
    assert got.shape == want.shape == (t, 1, np_, hn)
    assert (got - want).abs().max() <= 1e-5
    for a, b in zip(grads, leaves):
        assert (a - b.grad).abs().max() <= 1e-5


def test_padded_index_places_each_document_in_its_row():
    flat, n, width = padded_index(((0, 3), (3, 5), (5, 9)), torch.device("cpu"))
    assert (n, width) == (3, 4) and flat.tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]
