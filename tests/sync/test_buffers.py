"""BucketBuffers (megaforge.sync.buffers), the ipc transport's double buffer, on CPU tensors: SGLang's
flattened_bucket layout, and no buffer rewritten before the engine confirmed the bucket it carried."""
from __future__ import annotations

import pytest
import torch

from megaforge.sync import wire
from megaforge.sync.buffers import BucketBuffers


def _bucket(k: int, n: int = 3):
    g = torch.Generator().manual_seed(k)
    return [(f"b{k}.t{i}", torch.randn(5 + i, 4, generator=g).to(torch.bfloat16 if i % 2 else torch.float32))
            for i in range(n)] + [(f"b{k}.ids", torch.arange(7, dtype=torch.int64) + k)]


def test_layout_is_sglangs_flattened_bucket():
    pool = BucketBuffers("cpu")
    named = _bucket(0)
    flat, metas, slot = pool.flatten(named)
    ref_flat, ref_metas = wire.flatten(named, shared=False)
    assert torch.equal(flat, ref_flat)
    assert [(m.name, m.start_idx, m.end_idx, m.dtype) for m in metas] == \
        [(m.name, m.start_idx, m.end_idx, m.dtype) for m in ref_metas]
    back = dict(wire.unflatten(flat, metas))
    for n, t in named:
        assert torch.equal(back[n], t)


def test_a_buffer_is_rewritten_only_after_its_confirmation():
    pool = BucketBuffers("cpu", count=2)
    events, expected = [], {}

    def confirm(k, flat_view_bytes):
        def done():
            # the bucket is still intact in its buffer when the engine confirms it
            assert torch.equal(pool.bufs[k % 2][: flat_view_bytes.numel()], flat_view_bytes), f"bucket {k} overwritten early"
            events.append(("confirmed", k))
        return done

    for k in range(5):
        flat, metas, slot = pool.flatten(_bucket(k))
        assert slot == k % 2
        events.append(("written", k))
        expected[k] = flat.clone()
        pool.sent(slot, confirm(k, expected[k]))
    pool.close()
    # bucket k + 2 is written only after bucket k's confirmation; everything confirmed at close
    for k in range(3):
        assert events.index(("confirmed", k)) < events.index(("written", k + 2))
    assert sorted(e for e in events if e[0] == "confirmed") == [("confirmed", k) for k in range(5)]
    assert pool.stats["waits"] == 5 and pool.stats["allocs"] == 2 and pool.stats["buckets"] == 5
    assert pool.bufs == [None, None]


def test_growth_and_misuse():
    pool = BucketBuffers("cpu")
    flat, _, s0 = pool.flatten(_bucket(0))
    pool.sent(s0, lambda: None)
    with pytest.raises(RuntimeError, match="sent twice"):
        pool.sent(s0, lambda: None)
    big = [("big", torch.zeros(10_000))]
    flat, _, s1 = pool.flatten(big)
    pool.sent(s1, lambda: None)
    flat, _, s2 = pool.flatten(big)  # slot 0 grows for the larger bucket
    assert s2 == 0 and pool.bufs[0].numel() == 40_000 and pool.stats["allocs"] == 3
    with pytest.raises(ValueError, match="no tensors"):
        pool.flatten([])
    with pytest.raises(ValueError, match="is on meta"):
        pool.flatten([("m", torch.zeros(3, device="meta"))])
