"""The trainer interface every backend implements (torch: HF modules; megatron: megatron-core), and
the training skeleton they share.

The loop only ever talks to a trainer through these methods, so a backend plugs in without
touching the loop. All ranks of the trainer's process group call every method collectively.
A batch is given either whole to every rank (the backend takes its data-parallel share itself and
per-token results are gathered to every rank) or as each rank's *share* (``TrainBatch.is_share``,
what the loop hands off: :mod:`megaforge.driver.handoff`; per-token results are the share's rows).

The skeleton (:class:`Trainer`): ``train_step`` / ``sft_step`` split the batch into
``trainer.mini_batches`` mini-batches (each with the token / sequence counts its objective divides by),
for ``trainer.epochs`` passes; a mini-batch without a trained token is skipped (no optimizer step:
a zero gradient would still move the weights through Adam's momentum); each other one is a
backend's forward/backward (:meth:`Trainer._forward_backward`) and one optimizer step (LR schedule
:func:`~megaforge.trainer.optim.lr_at`, then the backend's :meth:`Trainer._clip_and_step`; a
non-finite gradient norm skips it). Metrics are values: the loss returns its micro-batch statistics
(:class:`~megaforge.algorithms.stats.Stat`), which stay on the device, summed over the micro-batches
and updates of the call, until :class:`~megaforge.trainer.metrics.StepMetrics` reduces them over the
ranks and copies them to the host once (:meth:`Trainer._stats_to_host`). The PPO critic
(:class:`Critic`) is updated the same way after the policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from megaforge import collective
from megaforge.algorithms import policy_objective
from megaforge.algorithms.stats import Stat, contribution
from megaforge.data.batch import set_denominators, share_after_first_mini, share_mini_batches, share_of
from megaforge.memory.offload import PinnedOffloader
from megaforge.memory.state import host_reservation
from megaforge.trainer.metrics import COUNT, MEAN, StepMetrics, world_stats_to_host
from megaforge.trainer.optim import lr_at
from megaforge.specs import TrainerSpec, expect
from megaforge.trainer.served_teacher import build_served_teacher
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


#: the micro-batch statistics of one mini-batch's forward/backward on this rank, summed over its
#: micro-batches on the device (not yet reduced over ranks, not read by the host)
Stats = dict[str, Stat]
#: an optimizer update's own values, on the host and equal on every rank: {name: (value, "mean" | "count")}
UpdateValues = dict[str, tuple[float, str]]


@dataclass(frozen=True)
class Objective:
    """What a backend's forward/backward computes for one kind of update: token-aligned logprobs at
    ``temperature`` (and the policy entropy when ``entropy``; rows packed several per row where the
    backend can when ``packed``; only at the trained positions, 0 elsewhere, when
    ``trained_positions``: the loss reads no other), then ``loss(logprobs [b, T], entropy [b, T] or None, micro_batch)
    -> (scalar loss contribution, {metric: Stat})`` with the micro-batch's rows on the trainer's
    device (:mod:`megaforge.algorithms.stats`: each statistic declares its reduction)."""

    temperature: float
    entropy: bool
    packed: bool
    loss: Callable
    trained_positions: bool = False


def sft_loss(logprobs: torch.Tensor, entropy, mb: TrainBatch):
    """-sum of the response tokens' logprobs / the mini-batch's trained-token count (a ``sum``
    contribution: micro-batches and ranks add up to the mini-batch's token mean)."""
    loss = -(logprobs * mb.loss_mask.to(logprobs.dtype)).sum() / mb.num_tokens
    return loss, {"loss": contribution(loss)}


SFT = Objective(temperature=1.0, entropy=False, packed=True, loss=sft_loss)


class Critic(ABC):
    """The PPO value model a backend trains beside the policy (:meth:`Trainer.init_critic`); the
    skeleton runs its updates like the policy's (same mini-batches and epochs)."""

    @abstractmethod
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Token-aligned values (float32, CPU), no gradient: [B, T] on every rank for a whole batch,
        the share's [n, T] rows for a share."""

    @abstractmethod
    def forward_backward(self, mini: TrainBatch) -> Stats:
        """Value-loss gradients of ``mini``, this rank's rows of a mini-batch with the whole mini-batch's
        counts (it has ``values`` = V_old and ``returns``); returns the ``critic/...`` statistics summed
        over this rank's micro-batches, on the device."""

    @abstractmethod
    def step(self) -> UpdateValues:
        """Clipped optimizer step at the constant ``critic.lr``: ``{"critic/grad_norm": (norm, "mean")}``."""

    @abstractmethod
    def offload_entries(self, tags) -> list:
        """The critic's tensors an offload moves (all are ``state``)."""


class Trainer(ABC):
    #: weight version: 0 at start, +1 after every optimizer step
    version: int = 0
    #: the backend's megaforge.memory offloader (None: nothing to move, e.g. on CPU)
    _mem = None

    def __init__(self, spec: TrainerSpec, tokenizer=None):
        # self.cfg: the TrainerSpec (megaforge.build.RunBuilder.trainer_spec), not the whole configuration
        self.cfg, self.tokenizer = expect(spec, TrainerSpec, type(self).__name__), tokenizer
        self.params = spec.objective
        self.temperature = spec.grpo.temperature
        self.ref = None  # the frozen reference policy (snapshot_reference)
        self.teacher = None  # the frozen distillation teacher (teacher.path; megaforge.trainer.teacher)
        self.served_teacher = None  # or the engine serving it (teacher.served_by engine; megaforge.trainer.served_teacher)
        if spec.teacher.path and spec.teacher.served_by == "engine":
            self.served_teacher = build_served_teacher(spec.teacher, spec.model, spec.rollout, spec.grpo.temperature,
                                                       tokenizer)
        self.critic: Critic | None = None  # the PPO critic (init_critic)
        self.version = 0
        self.sched: dict = {}

    @abstractmethod
    def compute_logprobs(self, batch: TrainBatch, model: str = "policy", positions: str = "all") -> torch.Tensor:
        """Token-aligned logprobs (temperature applied) of ``model`` in {"policy", "ref", "teacher"}, on CPU,
        float32; 0 at t = 0 and on padding. No gradient. [B, T] on every rank for a whole batch
        (gathered); the share's [n, T] rows for a share (``batch.is_share``: nothing gathered).
        ``positions``: "all" (every 1 <= t < length: parity checks, engine comparisons) or "trained"
        (only where loss_mask > 0, 0 elsewhere: pi_old and the reference of an RL step, whose readers
        all mask by loss_mask; the torch backend then runs its LM head there alone)."""

    def teacher_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The distillation teacher's log-probs of ``batch``'s tokens at its trained positions, [n, T]
        float32 at ``grpo.temperature``, 0 elsewhere: ``compute_logprobs(batch, "teacher", "trained")``,
        or the engine's (``teacher.served_by: engine``, :mod:`megaforge.trainer.served_teacher`)."""
        if self.served_teacher is not None:
            return self.served_teacher.logprobs(batch)
        return self.compute_logprobs(batch, "teacher", positions="trained")

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL update on ``batch`` (mini-batches x epochs as configured) with the objective of
        :func:`megaforge.algorithms.policy_objective`, then the critic's when there is one and the batch
        has returns. Returns batch-level metrics (at least ``loss``, ``pg_loss``, ``entropy``,
        ``clip_frac``, ``train_rollout_logprob_abs_diff``, ``grad_norm``, ``lr``; ``kl`` when a
        reference is used; ``critic/...``)."""
        rl = self._rl_objective()
        out = self._updates(batch, lambda mini: self._forward_backward(mini, rl), self._optimizer_step)
        if self.critic is not None and batch.returns is not None:
            out.update(self.train_critic(batch))
        return out

    def _rl_objective(self) -> Objective:
        return Objective(self.temperature, entropy=True, packed=False, loss=self._policy_loss, trained_positions=True)

    #: rows of the warm-up's two batches: other lengths the second time (torch.compile's first graph
    #: of a function is specialised to the shapes it met; a call with other shapes compiles the
    #: dynamic graph every later shape reuses)
    WARM_UP_LENGTHS = ((40,), (24, 56))

    def warm_up(self) -> None:
        """The RL step's kernels once before the first step: the no-grad forward of pi_old
        (``compute_logprobs``), of the frozen models the step also scores with (the reference where
        one is held, the distillation teacher where the trainer serves it: their own shapes compile
        their own graphs) and the policy objective's forward and backward on two small random
        batches (token ids below 16, advantages +-1, :attr:`WARM_UP_LENGTHS` per data-parallel rank
        and mini-batch), so that what compiles or initialises at its first call (torch.compile'd
        functions, e.g. megatron-core's fused RMSNorm / SwiGLU and megaforge's log-probs, each for the
        no-grad and the training pass; cuBLAS handles; attention kernels) does so here, beside the
        engines' start (megaforge.loop), not in step 1. Then the gradients are cleared: no optimizer
        step, so the weights, optimizer state and weight version are as before, and the random
        streams too (forked). Collective: every rank calls it."""
        m = self.cfg.trainer.mini_batches
        dp_rank, dp = self.data_parallel()
        g = torch.Generator().manual_seed(0)
        devices = [self.device] if getattr(self, "device", torch.device("cpu")).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for lengths in self.WARM_UP_LENGTHS:
                lengths = torch.tensor(lengths * (m * dp))
                B, T = len(lengths), int(lengths.max())
                t = torch.arange(T)[None]
                valid = t < lengths[:, None]
                mask = (valid & (t >= 4)).float()  # 4 prompt tokens, the rest trained
                adv = (torch.randint(0, 2, (B, 1), generator=g) * 2.0 - 1.0).expand(B, T) * mask
                batch = set_denominators(TrainBatch(
                    tokens=torch.randint(0, 16, (B, T), generator=g) * valid, lengths=lengths, loss_mask=mask,
                    advantages=adv.contiguous(), rollout_logprobs=-2.0 * mask))
                share = share_of(batch, m, dp_rank, dp)
                share.old_logprobs = self.compute_logprobs(share, "policy", positions="trained")
                for frozen in ("ref", "teacher"):
                    if getattr(self, frozen) is not None:
                        self.compute_logprobs(share, frozen, positions="trained")
                self._forward_backward(share_mini_batches(share)[0], self._rl_objective())
        self._clear_grads()

    def _clear_grads(self) -> None:
        """The policy's gradients back to none / zero (after :meth:`warm_up`)."""

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One supervised step: loss = -mean of logprobs over ``loss_mask`` tokens (no temperature)."""
        return self._updates(batch, lambda mini: self._forward_backward(mini, SFT), self._optimizer_step)

    def _policy_loss(self, logprobs, entropy, mb: TrainBatch):
        if self.params.entropy_coef == 0.0 and entropy is not None:
            entropy = entropy.detach()  # logged only
        return policy_objective(logprobs, mb, self.params, entropy)

    def train_critic(self, batch: TrainBatch) -> dict[str, float]:
        """The critic's value-loss updates on ``batch`` (needs ``values`` = V_old and ``returns``), over
        the policy's mini-batches x epochs; :meth:`train_step` runs them after the policy's. Returns
        the ``critic/...`` metrics averaged over the optimizer steps."""
        if batch.values is None or batch.returns is None:
            raise ValueError("train_critic: the batch needs values (V_old) and returns")
        return self._updates(batch, self.critic.forward_backward, self.critic.step, counts=False)

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size): which share of a batch it trains
        (:func:`megaforge.data.batch.share_of`). Every rank of the world is a DP rank here; a backend
        with model parallelism overrides it (its TP / CP / PP peers share one DP rank)."""
        return collective.rank(), collective.world()

    def set_old_logprobs(self, share: TrainBatch, every_row: bool = False) -> None:
        """pi_old's log-probs (the policy before this step's first update) of ``share``'s trained tokens
        as ``share.old_logprobs`` [n, T] (0 off loss_mask), the fixed denominator of the ratio over
        several updates. With one epoch and ``every_row`` False (only the ratio reads them), the first
        mini-batch's rows are left out (0, ``share.old_from_first_update``): its update runs at the very
        weights pi_old names, so the log-probs of its own forward, detached, are pi_old
        (:func:`~megaforge.algorithms.policy_objective` takes them for a micro-batch without
        ``old_logprobs``, as for a single update), exactly where a second forward would differ by the
        kernels' rounding. The no-grad forward then covers (M - 1) / M of the rows (M =
        ``trainer.mini_batches``). ``every_row``: every row computed (the KL reward penalty and
        distillation read pi_old of every token). Collective."""
        t = self.cfg.trainer
        if every_row or t.epochs != 1 or not share.is_share or len(share.minis) < 2:
            share.old_logprobs = self.compute_logprobs(share, "policy", positions="trained")
            return
        first = share.minis[0]
        lp = self.compute_logprobs(share_after_first_mini(share), "policy", positions="trained")  # [n - first.hi, <=T]
        old = torch.zeros(share.loss_mask.shape, dtype=lp.dtype)
        old[first.hi:, :lp.shape[1]] = lp
        share.old_logprobs, share.old_from_first_update = old, True

    def _mini_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """This rank's rows of each of the ``trainer.mini_batches`` contiguous mini-batches of
        ``batch`` (its share's, when ``batch`` is one), each with the trained-token and sequence
        counts of the whole mini-batch (the global batch of one optimizer step)."""
        m = self.cfg.trainer.mini_batches
        if not batch.is_share:
            batch = share_of(batch, m, *self.data_parallel())
        elif len(batch.minis) != m:
            raise ValueError(f"a batch share of {len(batch.minis)} mini-batches given to a trainer of "
                             f"trainer.mini_batches={m}")
        return share_mini_batches(batch)

    def _updates(self, batch: TrainBatch, forward_backward: Callable[[TrainBatch], Stats],
                 step: Callable[[], UpdateValues], counts: bool = True) -> dict[str, float]:
        """Mini-batches x epochs of ``forward_backward(mini)`` and ``step()``; empty mini-batches are
        skipped on every rank alike (their counts are global). The metrics of
        :class:`~megaforge.trainer.metrics.StepMetrics`: reduced over ranks and read by the host once,
        at the end; with ``counts``, also ``skipped``, ``updates`` and ``empty_minibatches``."""
        acc = StepMetrics()
        minis = [mini for _ in range(self.cfg.trainer.epochs) for mini in self._mini_batches(batch)]
        if batch.old_from_first_update:  # set_old_logprobs: the first update's own forward is pi_old
            if self.cfg.trainer.epochs != 1:
                raise ValueError("a batch whose first mini-batch has no pi_old (set_old_logprobs) trained "
                                 f"over trainer.epochs={self.cfg.trainer.epochs}: its rows need pi_old from epoch 2")
            minis[0] = minis[0].replace(old_logprobs=None)
        last = max((i for i, mini in enumerate(minis) if mini.num_tokens), default=-1)
        read = None
        for i, mini in enumerate(minis):
            if mini.num_tokens == 0:
                acc.add_empty()
                continue
            acc.add_stats(forward_backward(mini))
            if i == last:  # the statistics are complete: reduce and copy them while the last step runs
                read = acc.start_to_host(self._stats_to_host)
            acc.add_values(step())
        return acc.result(read or acc.start_to_host(self._stats_to_host), counts)

    def _stats_to_host(self, stats: Mapping[str, Stat], updates: int) -> Callable[[], dict[str, float]]:
        """The call's micro-batch ``stats`` (this rank's sums over its micro-batches and ``updates``
        updates, on the device) reduced over the data-parallel ranks
        (:func:`~megaforge.trainer.metrics.stack_and_reduce`) and copied to the host once; returns the
        reader of the host dict. Collective. Here every rank of the world is a DP rank holding the
        stats; a backend with model parallelism overrides it."""
        return world_stats_to_host(stats, updates, _world_reduce)

    @abstractmethod
    def _forward_backward(self, mini: TrainBatch, objective: Objective) -> Stats:
        """Gradients of ``objective`` on ``mini``, this rank's rows of a mini-batch with the whole
        mini-batch's ``num_tokens`` / ``num_seqs`` (micro-batches summed: the losses are contributions
        to the mini-batch's objective); returns its statistics summed over this rank's micro-batches,
        on the device (:func:`~megaforge.algorithms.stats.merge`; reduced over ranks by
        :meth:`_stats_to_host`)."""

    # ---------------------------------------------------------------------- optimizer
    def reset_optimizer(self, lr: float, total_steps: int, warmup_steps: int = 0,
                        schedule: str = "constant", min_lr: float = 0.0) -> None:
        """Fresh optimizer state and LR schedule (the loop calls it when a phase starts: SFT warm start,
        then RL); the optimizer itself is built once, by the constructor. ``schedule`` in constant |
        cosine | linear, over ``total_steps`` optimizer steps after ``warmup_steps`` of linear warm-up."""
        self._clear_optimizer_state()
        self.sched = dict(peak=lr, total=total_steps, warmup=warmup_steps, schedule=schedule, min_lr=min_lr, step=0)
        self._set_lr()

    def _set_lr(self) -> float:
        s = self.sched
        lr = lr_at(s["step"], s["peak"], s["total"], s["warmup"], s["schedule"], s["min_lr"])
        self._apply_lr(lr)
        return lr

    def _optimizer_step(self) -> UpdateValues:
        """LR of the schedule, then the backend's clipped step; a non-finite gradient norm skips it
        (``skipped``, counted over the call's updates: the loop counts consecutive skips against
        ``trainer.max_bad_steps``). ``grad_norm`` and ``lr`` are averaged over the updates."""
        lr = self._set_lr()
        norm, stepped = self._clip_and_step()
        if stepped:
            self.sched["step"] += 1
            self.version += 1
        return {"grad_norm": (norm, MEAN), "lr": (lr, MEAN), "skipped": (0.0 if stepped else 1.0, COUNT)}

    @abstractmethod
    def _clear_optimizer_state(self) -> None:
        """Forget the optimizer's state (Adam moments, step counts), as if it were new."""

    @abstractmethod
    def _apply_lr(self, lr: float) -> None:
        """Set the policy optimizer's learning rate."""

    @abstractmethod
    def _clip_and_step(self) -> tuple[float, bool]:
        """Clip the policy's ready gradients by ``trainer.grad_clip`` and step: (grad norm, stepped)."""

    # ------------------------------------------------------------------ models
    def _select_model(self, model: str, policy):
        """``policy``, the frozen reference or the distillation teacher, for ``compute_logprobs(model=...)``."""
        if model == "policy":
            return policy
        if model == "ref":
            if self.ref is None:
                raise RuntimeError("compute_logprobs(model='ref'): no reference model (snapshot_reference not called)")
            return self.ref
        if model == "teacher":
            if self.teacher is None:
                raise RuntimeError("compute_logprobs(model='teacher'): no teacher (teacher.path is not set)")
            return self.teacher
        raise ValueError(f"compute_logprobs: model must be 'policy', 'ref' or 'teacher', got {model!r}")

    @abstractmethod
    def init_critic(self) -> None:
        """A fresh critic (PPO / gae), a copy of the policy as it is now (the loop calls it at RL start,
        after any SFT warm start) with a zero value head."""

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values (token-aligned, float32, CPU, no gradient): [B, T] on every rank for a whole
        batch, the share's [n, T] rows for a share."""
        if self.critic is None:
            raise RuntimeError("compute_values: no critic (init_critic not called; see critic.enabled)")
        return self.critic.compute_values(batch)

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
        n_bad = int(collective.all_reduce_sum(torch.tensor([float(len(bad))])).item())
        if n_bad:
            here = ", ".join(bad[:limit]) + (f" and {len(bad) - limit} more" if len(bad) > limit else "")
            raise NonFiniteWeights(
                f"{n_bad} weight tensor(s) hold NaN or inf (rank {collective.rank()}: {here or 'none on this rank'}); "
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

    def export_adapter(self, path: str) -> None:
        """The policy's LoRA adapters as a PEFT adapter folder (backends with ``model.lora``)."""
        raise RuntimeError(f"{type(self).__name__}: model.lora is not supported by this backend")

    def reserve_offload(self) -> None:
        """Start pinning the host buffers of the coming offloads on a background thread
        (``memory.offload: pinned``), so that the first step's offload only copies. The loop calls it
        before the engines start. No-op without a pinned offloader."""
        if isinstance(self._mem, PinnedOffloader):
            self._mem.reserve(self.offload_reservation())

    @abstractmethod
    def offload_entries(self, tags) -> list:
        """The tagged tensors an offload moves (:class:`megaforge.memory.offload.Entry`)."""

    @abstractmethod
    def inner_optimizers(self) -> list:
        """The torch optimizers whose state the offload moves (for :meth:`offload_reservation`)."""

    def offload_reservation(self) -> dict:
        """{tag: host bytes} of the offloads to come: the current weights and state, the Adam moments
        the optimizers create at their first step, and the frozen reference the run will snapshot."""
        out = host_reservation(self.offload_entries, self.inner_optimizers())
        if (self.cfg.grpo.beta > 0 and self.cfg.trainer.ref_device != "cpu" and self.ref is None
                and self.cfg.model.lora is None):  # a LoRA run's reference is its own base
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


def _world_reduce(vec: torch.Tensor, op: str) -> torch.Tensor:
    """Elementwise ``op`` ("sum" | "max") of ``vec`` over the world (:mod:`megaforge.collective`)."""
    return collective.all_reduce_sum(vec) if op == "sum" else collective.all_reduce_max(vec)
