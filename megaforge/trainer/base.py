"""The trainer interface every backend implements (torch: HF modules; megatron: megatron-core).

The loop only ever talks to a trainer through these methods, so a backend plugs in without
touching the loop. All ranks of the trainer's process group call every method collectively;
batches are given whole to every rank (the backend takes its data-parallel share itself).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from megaforge import dist
from megaforge.memory.offload import PinnedOffloader
from megaforge.memory.state import host_reservation
from megaforge.types import TrainBatch

HFBucket = list[tuple[str, torch.Tensor]]


class NonFiniteWeights(RuntimeError):
    """Weights hold NaN or inf: they are not written to a checkpoint."""


def modules_weights(**modules) -> Iterator[tuple[str, torch.Tensor]]:
    """``(prefix.name, parameter)`` of every given module that is not None."""
    for prefix, mod in modules.items():
        if mod is not None:
            for name, p in mod.named_parameters():
                yield f"{prefix}.{name}", p


class Trainer(ABC):
    #: weight version: 0 at start, +1 after every optimizer step
    version: int = 0

    @abstractmethod
    def compute_logprobs(self, batch: TrainBatch, model: str = "policy") -> torch.Tensor:
        """Token-aligned logprobs [B, T] (temperature applied) of ``model`` in {"policy", "ref"},
        on CPU, float32; 0 at t = 0 and on padding. No gradient."""

    @abstractmethod
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on ``batch`` (mini-batches x epochs as configured) with the objective of
        :func:`megaforge.algorithms.policy_objective`. Returns batch-level metrics (at least
        ``loss``, ``pg_loss``, ``entropy``, ``clip_frac``, ``train_rollout_logprob_abs_diff``,
        ``grad_norm``, ``lr``; ``kl`` when a reference is used)."""

    @abstractmethod
    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One supervised step: loss = -mean of logprobs over ``loss_mask`` tokens (no temperature)."""

    @abstractmethod
    def reset_optimizer(self, lr: float, total_steps: int, warmup_steps: int = 0,
                        schedule: str = "constant", min_lr: float = 0.0) -> None:
        """Fresh optimizer and LR schedule (the loop calls it when a phase starts: SFT warm start,
        then RL). ``schedule`` in constant | cosine | linear, over ``total_steps`` optimizer steps
        after ``warmup_steps`` of linear warm-up."""

    @abstractmethod
    def snapshot_reference(self) -> None:
        """Copy the current policy weights into the frozen reference model (RL start, after any
        SFT warm start). Only called when the objective needs a reference (grpo.beta > 0 or KL
        logged); the reference is part of what :meth:`save` / :meth:`load` keep."""

    @abstractmethod
    def iter_hf_buckets(self, max_bytes: int) -> Iterator[HFBucket]:
        """The policy's weights as Hugging Face ``(name, tensor)`` lists of at most ``max_bytes``
        each (a single tensor larger than that forms its own bucket). Every rank calls it; only
        the ranks that hand weights to engines receive non-empty buckets."""

    @abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weight tensors that :meth:`save` writes (policy, reference, critic), by name."""

    def check_finite(self, limit: int = 8) -> None:
        """Collective: :class:`NonFiniteWeights` naming (up to ``limit`` of) this rank's tensors that
        hold NaN or inf when any rank has one; every backend's :meth:`save` calls it first."""
        bad = [name for name, t in self.named_weights() if not bool(torch.isfinite(t.detach()).all())]
        n_bad = int(dist.all_reduce_sum(torch.tensor([float(len(bad))])).item())
        if n_bad:
            here = ", ".join(bad[:limit]) + (f" and {len(bad) - limit} more" if len(bad) > limit else "")
            raise NonFiniteWeights(
                f"{n_bad} weight tensor(s) hold NaN or inf (rank {dist.rank()}: {here or 'none on this rank'}); "
                f"no checkpoint was written (the earlier ones are intact). Lower trainer.lr or check the data")

    @abstractmethod
    def save(self, path: str) -> None:
        """Model, optimizer and scheduler state into directory ``path`` (collective); refuses
        non-finite weights (:meth:`check_finite`) before writing anything."""

    @abstractmethod
    def load(self, path: str) -> None:
        """Restore what :meth:`save` wrote (collective)."""

    @abstractmethod
    def export_hf(self, path: str) -> None:
        """A Hugging Face model directory (safetensors + config) loadable by transformers."""

    #: the backend's megaforge.memory offloader (None: nothing to move, e.g. on CPU)
    _mem = None

    def reserve_offload(self) -> None:
        """Start pinning the host buffers of the coming offloads on a background thread
        (``memory.offload: pinned``), so that the first step's offload only copies. The loop calls it
        before the engines start. No-op without a pinned offloader."""
        if isinstance(self._mem, PinnedOffloader):
            self._mem.reserve(self.offload_reservation())

    def offload_entries(self, tags) -> list:
        """The tagged tensors an offload moves (:class:`megaforge.memory.offload.Entry`)."""
        return []

    def inner_optimizers(self) -> list:
        """The torch optimizers whose state the offload moves (for :meth:`offload_reservation`)."""
        return []

    def offload_reservation(self) -> dict:
        """{tag: host bytes} of the offloads to come: the current weights and state, the Adam moments
        the optimizers create at their first step, and the frozen reference the run will snapshot."""
        out = host_reservation(self.offload_entries, self.inner_optimizers())
        cfg = getattr(self, "cfg", None)
        if cfg is not None and cfg.grpo.beta > 0 and cfg.trainer.ref_device != "cpu" and getattr(self, "ref", None) is None:
            out["state"] += out["weights"]  # a copy of the policy's parameters
        return out

    def offload(self, tags=None) -> None:
        """Move trainer state off the accelerator (colocated mode; ``memory.offload``): ``tags`` of
        ``weights`` (what :meth:`iter_hf_buckets` reads) and ``state`` (gradients, optimizer, reference),
        all when None; tags already offloaded are skipped. No-op without an offloader."""
        if self._mem is not None:
            self._mem.offload(tags)

    def onload(self, tags=None) -> None:
        """Bring ``tags`` (all when None) back; tags not offloaded are skipped."""
        if self._mem is not None:
            self._mem.onload(tags)

    @property
    def is_engine_feeder(self) -> bool:
        """True on the rank that talks to rollout engines (global rank 0 by default)."""
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


class StepMetrics:
    """Averages per-optimizer-step metrics over the mini-batches x epochs of one ``train_step``.

    ``skipped`` is the number of optimizer steps skipped for a non-finite gradient (summed, not
    averaged); ``empty_minibatches`` counts mini-batches with no trained token (every response empty,
    e.g. all requests aborted), for which no optimizer step runs at all: a zero gradient would still
    move the weights through Adam's momentum.
    """

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.steps = 0
        self.empty = 0

    def add(self, step: dict[str, float]) -> None:
        for k, v in step.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        self.steps += 1

    def add_empty(self) -> None:
        self.empty += 1

    def result(self) -> dict[str, float]:
        out = {k: v / self.steps for k, v in self.totals.items()} if self.steps else {}
        out["skipped"] = self.totals.get("skipped", 0.0)
        out["empty_minibatches"] = float(self.empty)
        return out

