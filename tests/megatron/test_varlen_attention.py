"""The torch spec's varlen flash-attention path equals per-document SDPA (CUDA only: flash
attention has no CPU kernel; on CPU the trainer takes the per-document loop)."""
import pytest
import torch
import torch.nn.functional as F

from megaforge.trainer.megatron.layers import _varlen_fn, varlen_causal_attention

cuda = pytest.mark.skipif(not torch.cuda.is_available() or _varlen_fn()[0] is None,
                          reason="needs CUDA and torch.nn.attention.varlen")


def per_document(q, k, v, cu, scale):
    """Reference: one causal SDPA per document, float32, GQA by repetition. [t, h, d] -> [t, h, d]."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (x[lo:hi].float().transpose(0, 1) for x in (q, k, v))
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


@cuda
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_varlen_equals_per_document_sdpa_with_grads(heads):
    torch.manual_seed(0)
    lens = [37, 300, 1, 128, 91]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    t, (hq, hk), d = cu[-1], heads, 64
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hk, hk))
    w = torch.randn(t, hq, d, device="cuda")
    out = varlen_causal_attention(q, k, v, torch.tensor(cu, device="cuda", dtype=torch.int32), 512, d ** -0.5)
    (out.float() * w).sum().backward()
    got = [out.detach().float()] + [x.grad.float() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    ref = per_document(q, k, v, cu, d ** -0.5)
    (ref * w).sum().backward()
    want = [ref.detach()] + [x.grad.float() for x in (q, k, v)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 2e-2, (name, rel)  # bf16 operands
