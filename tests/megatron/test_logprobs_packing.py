"""Single-process checks of the vocab-parallel logprob/entropy function and of thd packing."""
import pytest
import torch

from megaforge.trainer.megatron.logprobs import vocab_parallel_argmax, vocab_parallel_logprobs
from megaforge.trainer.megatron.packing import pack


def test_logprobs_entropy_and_grads_ignore_padded_vocab():
    torch.manual_seed(0)
    N, V, Vp, tau = 7, 11, 16, 0.7
    logits = torch.randn(N, Vp, dtype=torch.float64).float().requires_grad_(True)
    labels = torch.randint(0, V, (N,))
    w1, w2 = torch.randn(N), torch.randn(N)
    lp, ent = vocab_parallel_logprobs(logits, labels, V, temperature=tau)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits[:, :V] / tau, -1)
    rlp, rent = ref.gather(-1, labels[:, None])[:, 0], -(ref.exp() * ref).sum(-1)
    ((rlp * w1).sum() + (rent * w2).sum()).backward()
    # float32 over 11 columns in another formula (max-shifted sums vs log_softmax): |lp| and H are
    # <= ~4 (ulp 4.8e-7) and grads <= 1; measured 4.8e-7 (1 ulp). 1e-5 is ~20 ulp; a wrong temperature
    # or a padded column counted moves them by >= 1e-2.
    assert (lp - rlp).abs().max() < 1e-5 and (ent - rent).abs().max() < 1e-5
    assert (got - logits.grad).abs().max() < 1e-5
    assert got[:, V:].abs().max() == 0  # padded columns get no gradient
    big = logits.detach().clone()
    big[:, V:] = 100.0  # padded columns never win nor count
    assert torch.equal(vocab_parallel_argmax(big, V), big[:, :V].argmax(-1))
    assert (vocab_parallel_logprobs(big, labels, V, tau)[0] - rlp).abs().max() < 1e-5


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_fused_kernels_equal_eager_formulas(device):
    """trainer.fused_logprobs: the torch.compile'd sums and gradient (inductor's C++ backend on CPU,
    Triton on CUDA) give the eager path's values on bf16 logits with a padded vocabulary, with and
    without an entropy gradient."""
    torch.manual_seed(1)
    N, V, Vp = 37, 50, 64
    base = (3 * torch.randn(N, Vp)).bfloat16().to(device)
    labels = torch.randint(0, V, (N,)).to(device)
    w1, w2 = torch.randn(N).to(device), torch.randn(N).to(device)
    res = {}
    for fused in (False, True):
        for detach_ent in (False, True):
            logits = base.clone().requires_grad_(True)
            lp, ent = vocab_parallel_logprobs(logits, labels, V, temperature=1.0, fused=fused)
            ent_term = (ent.detach() if detach_ent else ent) * w2
            ((lp * w1).sum() + ent_term.sum()).backward()
            res[fused, detach_ent] = (lp.detach(), ent.detach(), logits.grad.float())
    ref = torch.log_softmax(base.float()[:, :V], -1)
    # float32 sums over the 50 real columns, the compiled kernel in its own (vectorised) order: a sum
    # of K terms differs by <= K * eps * sum|terms| between orders; the entropy's sum p * z has
    # sum|p z| <= ~10 (|z| <= ~10 after the max shift): <= 50 * 1.2e-7 * 10 = 6e-5, the logprobs'
    # log-sum-exp <= 50 * eps = 6e-6. Measured 9.5e-7 (lp) and 1.9e-6 (H). Bound 1e-4.
    assert (res[True, False][0] - ref.gather(-1, labels[:, None])[:, 0]).abs().max() < 1e-4
    for d in (False, True):
        (lp0, e0, g0), (lp1, e1, g1) = res[False, d], res[True, d]
        assert (lp0 - lp1).abs().max() < 1e-4 and (e0 - e1).abs().max() < 1e-4
        # bf16 gradients (8-bit mantissa): one rounding apart is <= 2^-8 * max|g| ~ 3.9e-3 * max|g|
        assert (g0 - g1).abs().max() < 1e-2 * g0.abs().max()
        assert g1[:, V:].abs().max() == 0
    assert (res[True, False][2] - res[True, True][2]).abs().max() > 1e-3  # the entropy term counts


def test_pack_cp2_sp_layout_covers_every_token_once():
    tokens = torch.arange(1, 41).reshape(4, 10)
    lengths = torch.tensor([10, 3, 7, 1])
    parts = [pack(tokens, lengths, cp_size=2, cp_rank=r, tp_sp=2) for r in range(2)]
    total = parts[0].total
    assert total % (2 * 2) == 0 and all(p.tokens.shape[1] * 2 == total for p in parts)
    pos = torch.cat([p.local_pos for p in parts])
    assert torch.equal(pos.sort().values, torch.arange(total))
    # each row is padded to a multiple of 2 * cp = 4: 12, 4, 8, 4 (+ growth of the last row for SP)
    cu = parts[0].packed_seq_params.cu_seqlens_q_padded.tolist()
    assert cu[:4] == [0, 12, 16, 24] and cu[-1] == total
    assert parts[0].packed_seq_params.cu_seqlens_q.tolist() == [0, 10, 13, 20, 21]
    # labels are the next token of the same row, 0 at a row's last real token
    glob_tok = torch.zeros(total, dtype=torch.long)
    glob_lab = torch.zeros(total, dtype=torch.long)
    for p in parts:
        glob_tok[p.local_pos] = p.tokens[0]
        glob_lab[p.local_pos] = p.labels[0]
    assert glob_tok[:10].tolist() == list(range(1, 11)) and glob_lab[:10].tolist() == list(range(2, 11)) + [0]
    # to_rows: value at packed position j lands on (row, t) with j predicting token t
    gathered = torch.cat([p.local_pos.float() for p in parts])  # rank-major gather of "position"
    rows = parts[0].to_rows(gathered)
    assert rows[0, 1:10].tolist() == list(range(0, 9)) and rows[0, 0] == 0
    assert rows[1, 1:3].tolist() == [12, 13] and rows[1, 3:].abs().sum() == 0
    assert rows[3].abs().sum() == 0  # a one-token row predicts nothing


def test_max_seqlen_is_a_bucketed_upper_bound():
    from megaforge.trainer.megatron.packing import max_seqlen_bucket, padded_lengths

    assert [max_seqlen_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
    assert [max_seqlen_bucket(n, 4) for n in (1, 4, 5, 12, 17)] == [4, 4, 8, 16, 32]  # align * 2**k
    assert padded_lengths([10, 3, 7, 1], cp_size=2, tp_sp=2) == [12, 4, 8, 4]  # rows rounded up to 2c = 4
    assert padded_lengths([10, 3, 7, 1], cp_size=2, tp_sp=3) == [12, 4, 8, 12]  # last grows: total % (c * tp) == 0
    assert padded_lengths([5, 6], multiple=16) == [5, 11]
    tokens = torch.arange(1, 41).reshape(4, 10)
    for lengths in ([10, 3, 7, 1], [6, 5, 9, 2]):  # different longest rows, one bucket
        p = pack(tokens, torch.tensor(lengths), cp_size=2, cp_rank=0).packed_seq_params
        assert p.max_seqlen_q == p.max_seqlen_kv == 16


def test_padded_offsets_are_the_real_ones_object_when_nothing_is_padded():
    """Transformer Engine 2.20's DotProductAttention decides pad_between_seqs by identity: padded cu_seqlens that
    *are* the real ones mean no padding; another tensor means padding, whatever its values, and rules out its
    FlashAttention and unfused backends for thd. So pack hands the same tensor where no row is padded, and a
    separate one wherever a row is (SP's tail, FP8's multiple of 16, CP)."""
    tokens = torch.arange(1, 41).reshape(4, 10)
    lengths = torch.tensor([10, 3, 7, 4])  # 24 tokens: a multiple of 2 (SP at TP 2) and of 8, not of 16
    for host in (False, True):
        p = pack(tokens, lengths, host_cu_seqlens=host).packed_seq_params
        assert p.cu_seqlens_q_padded is p.cu_seqlens_q and p.cu_seqlens_kv_padded is p.cu_seqlens_kv
        assert p.cu_seqlens_q is p.cu_seqlens_kv and p.cu_seqlens_q.tolist() == [0, 10, 13, 20, 24]
        sp = pack(tokens, lengths, tp_sp=2, host_cu_seqlens=host).packed_seq_params  # 24 % 2 == 0: no padding
        assert sp.cu_seqlens_q_padded is sp.cu_seqlens_q
        for padded in (pack(tokens, lengths, multiple=16, host_cu_seqlens=host),  # 24 -> 32: the last row grows
                       pack(tokens, lengths, cp_size=2, cp_rank=0, host_cu_seqlens=host)):  # rows to multiples of 4
            q, q_pad = padded.packed_seq_params.cu_seqlens_q, padded.packed_seq_params.cu_seqlens_q_padded
            assert q_pad is not q and q_pad.tolist()[-1] == padded.total > q.tolist()[-1]


def test_to_rows_without_context_parallelism_skips_the_permutation():
    """cp 1: the gather order is the packed order, so to_rows indexes the values directly (2 fewer device ops a call,
    and their backward), with the same result as through the inverse permutation; cp 2 still permutes."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.arange(1, 41).reshape(4, 10)
    lengths = torch.tensor([10, 3, 7, 1])
    p = pack(tokens, lengths)
    assert p.cp_size == 1 and torch.equal(p.all_pos, torch.arange(p.total))
    vals = torch.randn(p.total, dtype=torch.float64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rows = p.to_rows(vals)
    assert not [e.name for e in prof.events() if e.name in ("aten::index_put_", "aten::arange")]
    assert torch.equal(rows, p.to_rows(vals.index_select(0, p.packed_order())))  # what the permuted path computes
    rows.sum().backward()
    assert vals.grad[p.src[p.valid]].eq(1).all() and vals.grad.sum() == p.valid.sum()
    parts = [pack(tokens, lengths, cp_size=2, cp_rank=r) for r in range(2)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        parts[0].to_rows(torch.cat([q.local_pos.double() for q in parts]))
    assert [e.name for e in prof.events() if e.name == "aten::index_put_"]  # cp 2: the inverse is built
