"""The offload copy engine (megaforge.memory.offload) on CPU-emulated paths: host buffers are plain CPU
tensors and the "device" storage is CPU memory, so identity, values, freeing, chunking, buffer reuse
and the weights/state split are checked exactly as on a GPU (tools/bench/bench_colocate.py measures speed)."""
from __future__ import annotations

import copy

import pytest
import torch

from mem_helpers import make_batch, snapshot, storage_bytes, torch_trainer_cfg
from megaforge.build import RunBuilder
from megaforge.memory import build_offloader
from megaforge.memory.offload import ALIGN, Entry, PinnedOffloader


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight  # tied: one Parameter, two modules

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (4, 6), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class Rig:
    """A tied model + AdamW, plus a megatron-like contiguous buffer whose views are 'parameters'
    (fixed, kept) and a gradient buffer (fixed, not kept)."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = Tied()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        _step(self.model, self.opt, 0)
        self.buf = torch.randn(300)
        self.views = [self.buf[:100].view(10, 10), self.buf[100:]]
        self.grad_buf = torch.randn(64)

    def entries(self, tags):
        out = []
        if "weights" in tags:
            out += [Entry(p, "weights") for p in self.model.parameters()]
            out += [Entry(self.buf, "weights", movable=False)]
        if "state" in tags:
            out += [Entry(v, "state") for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v)]
            out += [Entry(self.grad_buf, "state", keep=False, movable=False)]
        return out


def test_round_trip_identity_values_freeing_and_reuse():
    rig = Rig()
    twin = copy.deepcopy(rig)
    off = PinnedOffloader(rig.entries, "cpu", chunk_bytes=2048)
    ids = [id(p) for p in rig.model.parameters()] + [id(t) for st in rig.opt.state.values() for t in st.values()]
    for cycle in range(3):
        before = snapshot(rig.entries(("weights", "state")))
        kept = sum(t.numel() * t.element_size() for t, _ in before.values() if t is not rig.grad_buf)
        r = off.offload()
        assert r["bytes"] == kept  # every kept tensor once (the tied weight once), nothing more
        for t, _ in before.values():  # every storage of both tags is freed
            assert storage_bytes(t) == 0
        assert off.offloaded_tags == ["weights", "state"]
        off.onload()
        assert [id(p) for p in rig.model.parameters()] + [id(t) for st in rig.opt.state.values() for t in st.values()] == ids
        for t, v in before.values():
            if t is rig.grad_buf:
                assert torch.equal(t, torch.zeros_like(t)), "keep=False: zero after onload"
            else:
                assert torch.equal(t, v)
        assert torch.equal(rig.views[0].reshape(-1), rig.buf[:100]) and rig.views[1].data_ptr() == rig.buf[100:].data_ptr()
        assert rig.model.out.weight is rig.model.emb.weight
        if cycle == 0:
            allocs = dict(off.stats)
        else:  # host buffers are allocated once and reused
            assert off.stats == allocs
        _step(rig.model, rig.opt, cycle + 1)
        _step(twin.model, twin.opt, cycle + 1)
        rig.grad_buf.copy_(twin.grad_buf)  # (a gradient buffer is refilled by the next backward)
        for a, b in zip(rig.model.parameters(), twin.model.parameters()):
            assert torch.equal(a, b), "training after offload/onload differs from training without"


def test_chunks_are_bounded_aligned_and_coalesced():
    rig = Rig()
    off = PinnedOffloader(rig.entries, "cpu", chunk_bytes=2048)
    off.offload(["weights"])
    plan = off.plans["weights"]
    movable = [c for c in plan.chunks if not c.fixed]
    fixed = [c for c in plan.chunks if c.fixed]
    assert len(fixed) == 1 and fixed[0].slots[0].nbytes == 300 * 4
    for c in movable:
        assert c.nbytes <= 2048 or len(c.slots) == 1
        assert all(s.offset % ALIGN == 0 for s in c.slots)
    params = list(rig.model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    assert sum(s.nbytes for c in movable for s in c.slots) == total
    assert len(movable) >= 2  # 2 KiB chunks cannot hold the 3.2 KiB embedding and the rest
    off.onload(["weights"])
    # after the first onload each chunk is one storage: one copy per chunk from now on
    storages = {p.untyped_storage().data_ptr() for p in params}
    assert len(storages) == len(movable)
    assert all(p.is_contiguous() for p in params)


def test_weights_and_state_tags_and_replan():
    rig = Rig()
    off = PinnedOffloader(rig.entries, "cpu")
    off.offload(["state"])
    assert all(storage_bytes(p) > 0 for p in rig.model.parameters()), "weights stay while only the state is out"
    assert all(storage_bytes(t) == 0 for st in rig.opt.state.values() for t in st.values() if t.dim() > 0)
    assert off.offload(["state"])["tags"] == []  # already out: nothing happens
    assert off.onload(["weights"])["tags"] == []  # not out: nothing happens
    off.offload(["weights"])
    off.onload()
    plans, host = off.stats["plans"], off.host_bytes("state")
    # a new optimizer (another set of tensors) is planned anew at its first offload; the old host
    # buffers are dropped
    rig.opt = torch.optim.AdamW(rig.model.parameters(), lr=1e-3)
    _step(rig.model, rig.opt, 7)
    vals = snapshot(rig.entries(("state",)))
    off.offload()
    assert off.stats["plans"] == plans + 1  # state re-planned, weights reused
    assert off.host_bytes("state") == host  # same sizes, fresh buffers (the old ones were released)
    off.onload()
    for t, v in vals.values():
        if t is not rig.grad_buf:
            assert torch.equal(t, v)


def test_offload_rejects_tensors_on_another_device():
    t = torch.zeros(4)
    off = PinnedOffloader(lambda tags: [Entry(t, "state")], "meta")
    with pytest.raises(ValueError, match="is on cpu"):
        off.offload(["state"])


def test_torch_trainer_round_trips_and_trains_like_a_resident_one(tiny_model_dir, tmp_path):
    """TorchTrainer's own entries (policy, AdamW state, reference) through the copy engine between real
    train steps, the colocated order (state out, weights read, weights out), a checkpoint saved while
    offloaded: the same weights, metrics and checkpoint as a trainer that never offloads."""
    from megaforge.trainer.torch_backend import TorchTrainer

    cfg = torch_trainer_cfg(tiny_model_dir)
    a, b = TorchTrainer(RunBuilder(cfg).trainer_spec()), TorchTrainer(RunBuilder(cfg).trainer_spec())
    for tr in (a, b):
        tr.snapshot_reference()
    a._mem = PinnedOffloader(a.offload_entries, "cpu")
    batch = make_batch(vocab=512)
    for step in range(3):
        ma, mb = [], []
        for tr, out in ((a, ma), (b, mb)):
            tr.onload()
            bt = copy.deepcopy(batch)
            bt.ref_logprobs = tr.compute_logprobs(bt, "ref")
            out.append(tr.train_step(bt))
            tr.offload(["state"])
            out.append({n: t.clone() for bucket in tr.iter_hf_buckets(1 << 20) for n, t in bucket})
            tr.offload(["weights"])
        assert ma[0] == mb[0]
        assert ma[1].keys() == mb[1].keys() and all(torch.equal(ma[1][k], mb[1][k]) for k in ma[1])
        assert a._mem.offloaded_tags == ["weights", "state"]
        assert all(storage_bytes(p) == 0 for p in a.model.parameters())
        assert all(storage_bytes(p) == 0 for p in a.ref.parameters())
        if step == 0:
            allocs = a._mem.stats["host_allocs"]
    assert a._mem.stats["host_allocs"] == allocs, "no host buffer allocated after the first step"
    a.save(str(tmp_path / "a"))  # offloaded: saved with everything onloaded, offloaded again after
    b.save(str(tmp_path / "b"))
    assert a._mem.offloaded_tags == ["weights", "state"]
    sa = torch.load(str(tmp_path / "a" / "trainer.pt"), weights_only=True)
    sb = torch.load(str(tmp_path / "b" / "trainer.pt"), weights_only=True)
    for part in ("model", "ref"):
        assert all(torch.equal(sa[part][k], sb[part][k]) for k in sb[part])
    for k, st in sb["optimizer"]["state"].items():
        assert all(torch.equal(sa["optimizer"]["state"][k][n], v) for n, v in st.items())


def test_offload_modes_on_cpu_and_errors(tiny_model_dir):
    """memory.offload pinned/tms with a CPU trainer is a documented no-op (the state is in host memory
    already); an unknown mode names the key."""
    from megaforge.trainer.torch_backend import TorchTrainer

    assert build_offloader("none", "cuda", lambda tags: []) is None
    assert build_offloader("pinned", "cpu", lambda tags: []) is None
    assert build_offloader("tms", "cpu", lambda tags: []) is None
    with pytest.raises(ValueError, match="memory.offload 'fast'"):
        build_offloader("fast", "cpu", lambda tags: [])
    tr = TorchTrainer(RunBuilder(torch_trainer_cfg(tiny_model_dir, **{"memory.offload": "pinned"})).trainer_spec())
    assert tr._mem is None
    w = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.offload()
    assert all(torch.equal(v, w[k]) and storage_bytes(v) > 0 for k, v in tr.model.state_dict().items())
    tr.onload()


def test_tms_missing_names_the_package():
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_memory_saver is installed here")
    from megaforge.memory.tms import TmsOffloader

    with pytest.raises(ImportError, match="pip install torch-memory-saver"):
        TmsOffloader(lambda tags: [], "cpu")


def test_onload_allocates_every_chunk_inside_the_given_context():
    """The hook torch_memory_saver's migration uses: each device allocation of an onload runs inside a
    fresh context from ``alloc_ctx`` (here: one that records the bytes allocated inside it)."""
    import contextlib

    rig = Rig()
    off = PinnedOffloader(rig.entries, "cpu", chunk_bytes=2048)
    off.offload()
    inside = []

    @contextlib.contextmanager
    def region():
        before = {id(c.device_buf) for p in off.plans.values() for c in p.chunks if c.device_buf is not None}
        yield
        after = [c for p in off.plans.values() for c in p.chunks if c.device_buf is not None and id(c.device_buf) not in before]
        inside.append(sum(c.nbytes for c in after))

    off.onload(alloc_ctx=region)
    chunks = [c for p in off.plans.values() for c in p.chunks]
    assert len(inside) == len(chunks)  # one context per chunk
    assert sum(inside) == sum(c.nbytes for c in chunks if not c.fixed)  # every new chunk buffer made inside one
    assert torch.equal(rig.views[0].reshape(-1), rig.buf[:100])


def test_reserved_host_regions_cover_the_first_step(tiny_model_dir):
    """reserve() pins the host regions before the first offload (on the GPU: while the engines start),
    sized for what the first step's offload will hold: the policy, its reference and the Adam moments
    the optimizer creates at its first step. After it no offload of the run allocates host memory,
    and every step still trains exactly as a resident trainer."""
    from megaforge.trainer.torch_backend import TorchTrainer

    cfg = torch_trainer_cfg(tiny_model_dir)
    a, b = TorchTrainer(RunBuilder(cfg).trainer_spec()), TorchTrainer(RunBuilder(cfg).trainer_spec())
    a._mem = PinnedOffloader(a.offload_entries, "cpu")
    want = a.offload_reservation()
    a._mem.reserve(want)
    a._mem._wait_reserved()
    assert a._mem.stats["host_allocs"] == 2 and {t: r.numel() for t, r in a._mem._regions.items()} == want
    weights = sum(p.numel() * p.element_size() for p in a.model.parameters())
    assert weights <= want["weights"] and want["state"] >= 3 * weights  # reference + two Adam moments
    batch = make_batch(vocab=512)
    for tr in (a, b):
        tr.snapshot_reference()
    for step in range(2):
        out = []
        for tr in (a, b):
            tr.onload()
            bt = copy.deepcopy(batch)
            bt.ref_logprobs = tr.compute_logprobs(bt, "ref")
            out.append(tr.train_step(bt))
            tr.offload()
        assert out[0] == out[1]
    assert a._mem.stats["host_allocs"] == 2, "an offload allocated host memory after the reservation"
    small = PinnedOffloader(a.offload_entries, "cpu")
    small.reserve({"weights": 1024, "state": 1024})  # too small: the first plan pins a region that fits
    a.onload()
    small.offload(["weights"])
    assert small.stats["host_allocs"] == 3 and small._regions["weights"].numel() >= weights
    small.onload(["weights"])
