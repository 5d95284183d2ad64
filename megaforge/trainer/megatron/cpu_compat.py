"""Make megatron-core 0.16 run on a CPU-only torch (gloo process groups). Applied only on CPU.

megatron-core assumes CUDA in a few places; :func:`apply` patches exactly those (facts measured in
``shared/notes/megatron-on-cpu.md``):

1. the CUDA RNG tracker is replaced by one holding CPU generator states, seeded with the same offsets
   as ``model_parallel_cuda_manual_seed`` (attention always forks it);
2. ``torch.cuda.current_device()`` returns ``"cpu"`` (global memory buffer, TP gather buffers, rotary);
3. ``torch.cuda.synchronize`` is a no-op (checkpoint preload, pipeline p2p);
4. a ``TorchFunctionMode`` maps ``device="cuda"``, ``.cuda()`` and ``.to("cuda")`` to CPU and drops
   ``pin_memory`` (pipeline schedules, FP32Optimizer, rotary under CP); ``Tensor.type()`` names are
   reported as ``torch.cuda.*Tensor`` where the DistributedOptimizer checks them;
5. a stand-in for ``torch.cuda.Event`` (inference paths);
6. stand-ins for ``torch.cuda.Stream`` / ``current_stream`` / ``stream(...)`` (the MoE ``alltoall``
   token dispatcher copies routing counts to the host on a side stream; on CPU everything is
   synchronous, so streams are no-ops); the dispatcher's all-to-all split sizes stay CPU tensors
   (on GPU they become numpy arrays), which ``all_to_all_single`` rejects: the mode passes lists;
7. uneven ``all_gather`` / ``reduce_scatter`` (tensor lists of different lengths: the MoE
   dispatcher's expert-TP gather under sequence parallelism), which gloo rejects, run padded to
   the longest piece.

The patches are process-wide and idempotent; nothing here runs when the trainer's device is CUDA.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch.overrides import TorchFunctionMode

# Process-wide by nature: the patches change megatron's modules, which every trainer of the process shares.
_APPLIED = False


class CpuRNGStatesTracker:
    """Drop-in for megatron's ``CudaRNGStatesTracker`` over the CPU generator.

    ``fork(name)`` swaps the CPU generator state with the named state for the duration of the
    context, so randomness inside (init, dropout) is reproducible per name exactly as on GPU.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _FakeEvent:
    """``torch.cuda.Event`` stand-in: records wall time so ``elapsed_time`` stays meaningful."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


def _uneven_all_gather(out_list, tensor, group=None, async_op=False):
    """``all_gather`` into pieces of different first-dim lengths, by padding to the longest."""
    import torch.distributed as dist

    rows = max(t.shape[0] for t in out_list)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    bufs = [torch.empty_like(padded) for _ in out_list]
    dist.all_gather(bufs, padded, group=group)
    for o, b in zip(out_list, bufs):
        o.copy_(b[: o.shape[0]])


def _uneven_reduce_scatter(output, in_list, op=None, group=None, async_op=False):
    """``reduce_scatter`` of pieces of different first-dim lengths: all-reduce the padded pieces,
    keep this rank's."""
    import torch.distributed as dist

    rows = max(t.shape[0] for t in in_list)
    stacked = in_list[0].new_zeros((len(in_list), rows, *in_list[0].shape[1:]))
    for i, t in enumerate(in_list):
        stacked[i, : t.shape[0]] = t
    dist.all_reduce(stacked, op=op or dist.ReduceOp.SUM, group=group)
    output.copy_(stacked[dist.get_rank(group), : output.shape[0]])


def _bind(names, args, kwargs) -> dict:
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


class _FakeStream:
    """``torch.cuda.Stream`` stand-in: CPU work is synchronous, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _FakeEvent()
        event.record()
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = _FakeStream()


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)  # a bare index means a CUDA device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements in torch calls to CPU (patch 4)."""

    _TO_METHODS = {torch.Tensor.to}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.distributed.all_gather:
            a = _bind(("tensor_list", "tensor", "group", "async_op"), args, kwargs)
            if len({tuple(t.shape) for t in a["tensor_list"]}) > 1:
                return _uneven_all_gather(a["tensor_list"], a["tensor"], a.get("group"))
        if func is torch.distributed.reduce_scatter:
            a = _bind(("output", "input_list", "op", "group", "async_op"), args, kwargs)
            if len({tuple(t.shape) for t in a["input_list"]}) > 1:
                return _uneven_reduce_scatter(a["output"], a["input_list"], a.get("op"), a.get("group"))
        if func is torch.distributed.all_to_all_single:
            kwargs = {k: (v.tolist() if torch.is_tensor(v) and k.endswith("split_sizes") else v)
                      for k, v in kwargs.items()}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory or func is torch.Tensor.is_pinned:
            return args[0] if func is torch.Tensor.pin_memory else False
        if kwargs:
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = dict(kwargs, device="cpu")
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        return func(*args, **kwargs)


def model_parallel_cpu_manual_seed(seed: int) -> None:
    """``megatron.core.tensor_parallel.model_parallel_cuda_manual_seed`` over CPU generators
    (same seed offsets: data-parallel ``seed``, tensor-parallel ``seed + 2718 + tp_rank``, expert
    ``seed + 1024 + 100 * ep_rank + etp_rank``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank(),
    )


def apply() -> None:
    """Install the seven patches (idempotent). Call before building megatron modules on CPU."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.tensor_parallel import random as mrandom

    # 1. RNG tracker over CPU generator states.
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom.model_parallel_cuda_manual_seed = lambda seed, *a, **k: model_parallel_cpu_manual_seed(seed)
    # 2. / 3. / 5.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Event = _FakeEvent
    # 6. streams
    torch.cuda.Stream = _FakeStream
    torch.cuda.current_stream = lambda *a, **k: _DEFAULT_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # 4. device rewriting for the rest of the process.
    CudaToCpuMode().__enter__()
    _APPLIED = True
