"""The torch layer spec's packed attention on CUDA: the varlen flash-attention call (``SDPAttention._attend_varlen``,
aten's ``_flash_attention_forward`` and its C++ backward; what a bfloat16 training micro-batch uses on a GPU) against each document
attended alone in float32, forward and backward, beside the padded single SDPA call it replaces.

Tolerance: both bfloat16 paths are compared with the same float32 reference; the varlen path's largest error
may be at most 2x the padded path's + 1e-2 (bfloat16 keeps 8 bits of mantissa: one rounding of a value of
magnitude ~1 is 4e-3, and the two kernels block their sums differently). A varlen call that attended across
documents, or without the causal mask, is off by O(1)."""
import math

import pytest
import torch
import torch.nn.functional as F

from megaforge.trainer.megatron.layers import SDPAttention, varlen_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _attention(np_: int, hn: int) -> SDPAttention:
    att = SDPAttention.__new__(SDPAttention)  # the core attention alone, without megatron's parallel state
    torch.nn.Module.__init__(att)
    att.cp_group, att.np, att.hn, att.scale, att.dropout = None, np_, hn, 1 / math.sqrt(hn), 0.0
    return att


def _reference(q, k, v, docs, scale):
    """Each document alone, causal, float32: [t, 1, np, hn]."""
    outs = []
    for lo, hi in docs:
        qi, ki, vi = (x[lo:hi, 0].float().transpose(0, 1)[None] for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)[:, None]


def _run(fn, leaves, w):
    for x in leaves:
        x.grad = None
    out = fn(*leaves)
    (out.float() * w).sum().backward()
    return out.float(), [x.grad.float().clone() for x in leaves]


@pytest.mark.parametrize("lengths", [[300, 17, 1, 600, 88], [128, 128], [1000]])
def test_varlen_call_equals_each_document_alone(lengths):
    assert varlen_kernel() is not None, "this torch has no aten._flash_attention_forward with its C++ autograd"
    g = torch.Generator(device="cuda").manual_seed(sum(lengths))
    t, np_, ng, hn = sum(lengths), 14, 2, 64  # Qwen2.5-0.5B's heads
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    docs = list(zip(cu[:-1], cu[1:]))
    leaves = [torch.randn(t, 1, h, hn, device="cuda", generator=g).bfloat16().requires_grad_() for h in (np_, ng, ng)]
    w = torch.randn(t, 1, np_, hn, device="cuda", generator=g)
    att = _attention(np_, hn)
    assert att._varlen_ok(leaves[0]), "a bfloat16 CUDA micro-batch must take the varlen path"
    ref, ref_g = _run(lambda q, k, v: _reference(q, k, v, docs, att.scale), leaves, w)
    var, var_g = _run(lambda q, k, v: att._attend_varlen(q, k, v, docs), leaves, w)
    pad, pad_g = _run(lambda q, k, v: att._attend_padded(q, k, v, docs), leaves, w)
    assert var.shape == ref.shape == (t, 1, np_, hn)
    assert (var - ref).abs().max() <= 2 * (pad - ref).abs().max() + 1e-2
    for a, b, r in zip(var_g, pad_g, ref_g):
        assert (a - r).abs().max() <= 2 * (b - r).abs().max() + 1e-2 * r.abs().max().clamp(min=1)
