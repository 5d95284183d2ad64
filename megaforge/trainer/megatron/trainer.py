"""The Megatron-Core trainer backend (``trainer.backend: megatron``).

Every rank of the world constructs a :class:`MegatronTrainer` and calls every method collectively
with the *whole* batch. Layout: TP x CP x DP x PP from ``cfg.trainer``; each DP rank takes a
contiguous share of every mini-batch (sizes differ by at most one row), CP ranks of a DP replica see
the same rows and split every sequence, PP stages all receive the same micro-batches. Experts (MoE):
expert-TP x EP x expert-DP x PP (``trainer.expert_tensor_parallel``, ``trainer.expert_parallel``);
every DP rank runs the same number of micro-batches (filler micro-batches with loss mask 0 pad the
shorter shares: the experts' all-to-all joins DP ranks), and expert gradients are reduced over
expert-DP (:func:`megaforge.trainer.megatron.model.mark_expert_params`).

Losses and gradients. A micro-batch is ``micro_batch_size`` rows packed into one ``thd`` sequence.
Its loss is :func:`megaforge.algorithms.policy_objective` on token-aligned [b, T] logprobs (CP
pieces are all-gathered first, so every CP rank computes the micro-batch's full loss and backward
routes each rank only the gradient of its own tokens). ``num_tokens`` / ``num_seqs`` are those of the
mini-batch (the global batch of one optimizer step), so micro-batch losses *add up* to the
mini-batch objective: megatron's schedule runs with ``calculate_per_token_loss=True`` (no division
by the number of micro-batches), DDP sums gradients over DP x CP (no averaging) and
``finalize_model_grads`` is called without a token count (no rescaling). The result is the exact
gradient of the objective, whatever the layout or the micro-batching.

Metrics are values (:mod:`megaforge.algorithms.stats`, see ``policy_objective``): summed over the
micro-batches and optimizer steps of a call on the device of the last pipeline stage, all-reduced
over DP once per call, broadcast to all ranks and copied to the host once
(:meth:`MegatronTrainer._stats_to_host`).

Calling it: every rank of the world calls every method (all are collective) with the same
arguments; results (logprobs, metrics) are the same on every rank. ``iter_hf_buckets`` yields
tensors on global rank 0 only (empty lists elsewhere, same count) and must be consumed to the end
on every rank. On CPU, :mod:`cpu_compat` patches are installed process-wide by the constructor.

Profiling: ``megaforge.pack`` / ``.forward`` / ``.loss`` / ``.optimizer_step`` are
``record_function`` ranges; ``tools/bench/bench_train.py --trace DIR`` charges the device's idle time to them.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch.profiler import record_function

from megaforge.algorithms.stats import merge
from megaforge.collective import all_gather_rows, shard_range
from megaforge.convert import families
from megaforge.data.batch import token_budget_runs
from megaforge.hf import DTYPES
from megaforge.memory import build_offloader, onloaded
from megaforge.memory.state import ddp_entries, megatron_parts, on_device, param_entries
from megaforge.specs import TrainerSpec
from megaforge.trainer.base import HFBucket, Objective, Trainer, modules_weights
from megaforge.trainer.megatron import cpu_compat, lora_checkpoint, parallel, routing_replay
from megaforge.trainer.megatron import model as mmodel
from megaforge.trainer.megatron.checkpoint import load, save
from megaforge.trainer.megatron.critic import MegatronCritic
from megaforge.trainer.megatron.hf_export import export_hf, iter_hf_buckets
from megaforge.trainer.megatron.layers import DOCUMENTS_FORMAT, has_document_rotary
from megaforge.trainer.megatron.logprobs import vocab_parallel_argmax, vocab_parallel_logprobs
from megaforge.trainer.megatron.lora import MegatronLora, check_lora
from megaforge.trainer.megatron.micro_batch import MicroBatch, filler_rows, pack_rows
from megaforge.trainer.megatron.optim import (adam_optimizer, clipped_step, finalize_grads, set_lr_and_decay,
                                              state_resetter, wrap_ddp)
from megaforge.trainer.megatron.packing import padded_lengths
from megaforge.trainer.metrics import stack_and_reduce, to_host_later
from megaforge.trainer.teacher import build_megatron_teacher
from megaforge.types import TrainBatch


class MegatronTrainer(Trainer):
    def __init__(self, spec: TrainerSpec, tokenizer=None):
        super().__init__(spec, tokenizer)
        cfg, t = self.cfg, spec.trainer
        self.device = parallel.pick_device(t.device)
        if self.device.type == "cpu":
            cpu_compat.apply()
        parallel.init_distributed(self.device)
        parallel.init_model_parallel(t.tensor_parallel, t.pipeline_parallel, t.context_parallel, t.expert_parallel,
                                     t.expert_tensor_parallel)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        self.dtype = DTYPES[cfg.model.dtype]
        self.hf_config, source = mmodel.hf_source(cfg.model, self.device)
        self.family = families.family_of(self.hf_config)
        self.desc = self.family.describe(self.hf_config)
        if self.desc.is_moe and t.tensor_parallel > 1 and not t.sequence_parallel:
            raise ValueError("a mixture-of-experts model with trainer.tensor_parallel > 1 needs trainer.sequence_parallel: "
                             "true (megatron-core refuses to train MoE layers under TP without it)")
        self._routes_set = False  # a recorded routing was ever set on routers (later passes without one clear it)
        # LoRA wraps megatron's own linears: layer_spec auto means torch there (te is refused: check_lora)
        self.spec = mmodel.resolve_spec("torch" if cfg.model.lora is not None and t.layer_spec == "auto" else t.layer_spec)
        if cfg.model.lora is not None:
            check_lora(cfg.model.lora, t, self.spec, self.desc)
        self.tconfig = mmodel.transformer_config(self.desc, t, self.dtype, self.device.type == "cpu", self.spec)
        self.bm = mmodel.build_model(self.desc, self.family, self.tconfig, self.spec, self.device)
        mmodel.load_weights(self.bm, source)
        # model.lora: adapters on the frozen base (megaforge.trainer.megatron.lora); the reference is the
        # base with the adapters off, or with the adapters of a LoRA warm start (_ref_adapters)
        self.lora = MegatronLora(self.bm, cfg.model.lora, cfg.seed, t.sequence_parallel) if cfg.model.lora else None
        self._lora_ref, self._ref_adapters = False, None
        self.ddp = wrap_ddp(self.tconfig, self.bm.model, t.distributed_optimizer)
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.tconfig.finalize_model_grads_func = finalize_grads
        # Adam(W), distributed when configured; weight decay applies to every parameter
        self.optimizer = adam_optimizer(t, self.ddp, self.dtype, t.lr, t.min_lr)
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self._reset_optimizer_state = state_resetter(self.optimizer)
        self.reset_optimizer(t.lr, cfg.max_steps * t.mini_batches * t.epochs, t.warmup_steps, t.lr_schedule, t.min_lr)

        if cfg.teacher.path and cfg.teacher.served_by == "trainer":  # distillation: frozen GPTModel at the policy's layout
            self.teacher = build_megatron_teacher(self)
        # memory.offload: DDP buffers, optimizer state, reference, teacher to pinned host buffers (megaforge.memory)
        self._mem = build_offloader(cfg.memory.offload, self.device, self.offload_entries)

    # ------------------------------------------------------------------------------ groups
    @staticmethod
    def _ps():
        return ps

    def _tp_group(self):
        ps = self._ps()
        return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None

    def _cp_size(self) -> int:
        return self._ps().get_context_parallel_world_size()

    def _last_stage(self) -> bool:
        return self._ps().is_pipeline_last_stage()

    # --------------------------------------------------------------------------- optimizer
    def offload_entries(self, tags) -> list:
        """DDP buffers and optimizer tensors of the policy (and critic), the reference's and teacher's parameters."""
        out = ddp_entries(self.ddp, self.optimizer, tags)
        if self.critic is not None:
            out += self.critic.offload_entries(tags)
        if "state" in tags and self.ref is not None and self.cfg.trainer.ref_device != "cpu":
            out += param_entries(self.ref, "state")
        if "state" in tags and self.teacher is not None:
            out += param_entries(self.teacher, "state")
        return on_device(out, self.device)

    def inner_optimizers(self) -> list:
        opts = [self.optimizer] + ([self.critic.optimizer] if self.critic is not None else [])
        return [o.optimizer for opt in opts for o in megatron_parts(opt)]

    def _clear_optimizer_state(self) -> None:
        self._reset_optimizer_state()

    def _apply_lr(self, lr: float) -> None:
        set_lr_and_decay(self.optimizer, lr, self.cfg.trainer.weight_decay)

    def _clear_grads(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _clip_and_step(self) -> tuple[float, bool]:
        with record_function("megaforge.optimizer_step"):
            return clipped_step(self.optimizer, self.cfg.trainer.grad_clip)

    # ------------------------------------------------------------------------------ batches
    def data_parallel(self) -> tuple[int, int]:
        """(DP rank, DP size) of megatron's data-parallel group: TP / CP / PP peers share a DP rank."""
        ps = self._ps()
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def dp_rows(self, batch: TrainBatch) -> TrainBatch:
        """The rows this DP rank computes per-token results for: a share's own rows, or its contiguous
        ``shard_range`` of a whole batch (whose results :meth:`gather_rows` gathers over DP)."""
        if batch.is_share:
            return batch
        ps = self._ps()
        lo, hi = shard_range(batch.batch_size, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        if hi == lo:
            raise ValueError(
                f"a (mini-)batch of {batch.batch_size} sequences cannot feed "
                f"{ps.get_data_parallel_world_size()} data-parallel ranks: raise rollout.batch_size * "
                "grpo.n_samples or lower trainer.mini_batches")
        return batch.select(slice(lo, hi))

    def micro_batches(self, local: TrainBatch) -> list[MicroBatch]:
        ps = self._ps()
        sp = ps.get_tensor_model_parallel_world_size() if self.tconfig.sequence_parallel else 1
        cp_group = ps.get_context_parallel_group() if self._cp_size() > 1 else None
        if local.batch_size:
            lo, hi = int(local.tokens.min()), int(local.tokens.max())
            if lo < 0 or hi >= self.desc.vocab:
                raise ValueError(f"TrainBatch.tokens outside the vocabulary [0, {self.desc.vocab}): min {lo}, max {hi}")
        cp, multiple = self._cp_size(), 16 if self.cfg.trainer.fp8 else 1
        pack_fn = partial(pack_rows, cp_size=cp, cp_rank=ps.get_context_parallel_rank(), tp_sp=sp, device=self.device,
                          cp_group=cp_group, multiple=multiple, host_cu_seqlens=self.spec == "torch",
                          documents=cp == 1 and has_document_rotary(self.bm.model))  # torch spec models have it

        def local_len(rows: TrainBatch) -> int:
            return sum(padded_lengths(rows.lengths.tolist(), cp, sp, multiple)) // cp

        t = self.cfg.trainer  # rows end to end (each padded for CP), <= micro_batch_size rows / micro_batch_tokens
        runs = token_budget_runs(padded_lengths(local.lengths.tolist(), cp), t.micro_batch_size, t.micro_batch_tokens)
        mbs = [MicroBatch(mb, pack_fn, self.device, local_len(mb))
               for mb in (local.select(slice(a, b)) for a, b in runs)]
        n = self._even_micro_batch_count(len(mbs))
        if n > len(mbs):
            fill = filler_rows(local)
            mbs += [MicroBatch(fill, pack_fn, self.device, local_len(fill), filler=True) for _ in range(n - len(mbs))]
        return mbs

    def _even_micro_batch_count(self, n: int) -> int:
        """The number of micro-batches every data-parallel rank runs: ``n`` (this rank's), or, for a
        mixture-of-experts model with DP > 1, the largest ``n`` over the DP group. The experts'
        collectives (the EP all-to-all, the expert-TP all-gather) join ranks of different DP ranks
        once per MoE layer and micro-batch: a rank with fewer micro-batches would leave its peers
        waiting in the all-to-all forever. The missing ones are filler micro-batches
        (:func:`filler_rows`: loss mask 0, so they add exactly 0 to losses, gradients and metrics,
        and their per-token results are dropped). One all-reduce of an int per schedule call."""
        ps = self._ps()
        if not self.desc.is_moe or ps.get_data_parallel_world_size() == 1:
            return n
        box = torch.tensor([n], dtype=torch.long, device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        return int(box.item())

    def _token_values(self, logits: torch.Tensor, mb: MicroBatch, temperature: float, entropy: bool):
        """Token-aligned logprobs (and entropy) [b, T] from this rank's logits [1, t_local, V/tp]."""
        lp, ent = vocab_parallel_logprobs(logits[0], mb.packed.labels[0], self.desc.vocab, temperature,
                                          self._tp_group(), with_entropy=entropy, fused=self.cfg.trainer.fused_logprobs)
        lp = mb.packed.to_rows(self.cp_gather(lp))
        return lp, (mb.packed.to_rows(self.cp_gather(ent)) if entropy else None)

    def cp_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[t_local] per-position values -> [cp * t_local] (rank-major). What follows is computed
        identically on every CP rank, so backward keeps this rank's slice of the gradient."""
        if self._cp_size() == 1:
            return x

        return gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=False, group=self._ps().get_context_parallel_group())

    def run_schedule(self, module, mbs: list[MicroBatch], loss_fn, forward_only: bool) -> list:
        """Run megatron's (pipeline) schedule; ``loss_fn(mb, logits) -> (loss, dict)`` on the last stage
        (training: a dict of :class:`~megaforge.algorithms.stats.Stat`; forward only: per-row tensors).
        Returns the dicts of the last stage, one per real micro-batch (empty list elsewhere)."""
        def forward_step(data_iter, model):
            mb = next(data_iter)
            p = mb.packed
            if p.routes is not None or self._routes_set:
                self._set_routes(model, p.routes)
            if p.packed_seq_params.qkv_format == DOCUMENTS_FORMAT and not has_document_rotary(model):
                raise RuntimeError("a micro-batch packed for DocumentRotary (megaforge/trainer/megatron/layers.py) "
                                   "reached a model without it: its RoPE would be wrong")
            with record_function("megaforge.forward"):
                out = model(p.tokens, p.position_ids, None, packed_seq_params=p.packed_seq_params)
            return out, partial(_loss_wrapper, loss_fn, mb)

        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[module],
            num_microbatches=len(mbs), seq_length=max(m.local_len for m in mbs),
            micro_batch_size=1, forward_only=forward_only,
        )
        return [d for d, mb in zip(out, mbs) if not mb.filler]  # one dict per micro-batch on the last stage

    def _set_routes(self, model, routes: Optional[torch.Tensor]) -> None:
        """The next forward's recorded routing on ``model``'s routers (megaforge.trainer.megatron.routing_replay)."""
        ps = self._ps()
        sp = self.tconfig.sequence_parallel
        routing_replay.set_routes(model, routes, ps.get_tensor_model_parallel_rank() if sp else 0,
                                  ps.get_tensor_model_parallel_world_size() if sp else 1,
                                  replay=self.cfg.trainer.routing_replay)
        self._routes_set |= routes is not None

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """The base class's step; with a recorded routing (``batch.routed_experts``) also
        ``routing/replay_diff_frac`` of the policy's passes (megaforge.trainer.megatron.routing_replay)."""
        if batch.routed_experts is None:
            return super().train_step(batch)
        routing_replay.reset_stats(self.ddp)
        out = super().train_step(batch)
        counts = routing_replay.diff_counts(self.ddp, self.device)
        dist.all_reduce(counts)
        diff, total = counts.tolist()  # one copy to the host
        out["routing/replay_diff_frac"] = diff / total if total > 0 else 0.0
        return out

    def _from_last_stage(self, t: Optional[torch.Tensor], shape, dtype=torch.float32) -> torch.Tensor:
        """Broadcast a tensor computed on the last pipeline stage to every stage."""
        ps = self._ps()
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return t
        buf = t.to(self.device) if t is not None else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        return buf

    def _obj_from_last_stage(self, obj):
        ps = self._ps()
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ---------------------------------------------------------------------------- logprobs
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: str = "policy", positions: str = "all") -> torch.Tensor:
        """Every position is computed (the fused vocab-parallel loss); "trained" masks to loss_mask > 0."""
        if positions not in ("all", "trained"):
            raise ValueError(f"compute_logprobs: positions must be 'all' or 'trained', got {positions!r}")
        lp = self.forward_rows(batch, model, ("logprobs",))["logprobs"]
        return lp * (batch.loss_mask > 0).to(lp.dtype) if positions == "trained" else lp

    @torch.no_grad()
    def forward_rows(self, batch: TrainBatch, model: str = "policy", fields=("logprobs",)) -> dict:
        """Token-aligned [B, T] tensors on every rank, CPU (a share: its [n, T] rows): ``logprobs``
        (float32, temperature applied) and/or ``argmax`` (long: the model's most likely token at t given
        tokens[:t]). 0 at t = 0 and on padding."""
        lora_ref = model == "ref" and self._lora_ref
        module = self.ddp if lora_ref else self._select_model(model, self.ddp)
        unknown = set(fields) - {"logprobs", "argmax"}
        if unknown:
            raise ValueError(f"forward_rows: unknown fields {sorted(unknown)}; valid: logprobs, argmax")
        B, T = batch.tokens.shape
        module.eval()
        with self._ref_on_device(module), (self.lora.reference(self._ref_adapters) if lora_ref
                                           else contextlib.nullcontext()):
            local = self.dp_rows(batch)
            mbs = self.micro_batches(local)

            def loss_fn(mb, logits):
                out = {}
                if "logprobs" in fields:
                    out["logprobs"] = self._token_values(logits, mb, self.temperature, entropy=False)[0].float()
                if "argmax" in fields:
                    am = vocab_parallel_argmax(logits[0], self.desc.vocab, self._tp_group())
                    out["argmax"] = mb.packed.to_rows(self.cp_gather(am))
                return logits.sum() * 0.0, out

            out = self.run_schedule(module, mbs, loss_fn, forward_only=True)
        return {f: self.gather_rows(out, f, local.batch_size, B, T, torch.long if f == "argmax" else torch.float32,
                                    across_dp=not batch.is_share) for f in fields}

    def gather_rows(self, out: list, field: str, n_local: int, B: int, T: int, dtype,
                    across_dp: bool = True) -> torch.Tensor:
        """The [B, T] tensor (CPU, every rank) of per-micro-batch [b, <=T] values ``out[i][field]``
        computed on the last stage for this DP rank's ``n_local`` rows; ``across_dp=False`` (a share,
        B = ``n_local``): this DP rank's rows only, nothing gathered over the DP group."""
        full = None
        if self._last_stage():
            rows = torch.zeros(n_local, T, dtype=dtype, device=self.device)
            i = 0
            for d in out:
                rows[i:i + d[field].shape[0], : d[field].shape[1]] = d[field]
                i += d[field].shape[0]
            full = all_gather_rows(rows, B, self._ps().get_data_parallel_group()) if across_dp else rows
        return self._from_last_stage(full, (B, T), dtype).cpu()

    @onloaded
    def snapshot_reference(self) -> None:
        """Frozen copy of the current policy weights (same layout, no optimizer); on the CPU when
        ``trainer.ref_device: cpu`` (moved to the device only while it computes). With LoRA: the base with
        the adapters off (no copy), or with a copy of the adapters when they are not zero (warm start)."""
        if self.lora is not None:
            self._lora_ref = True
            self._ref_adapters = None if self.lora.fresh() else self.lora.local_state()
            return
        if self.ref is None:
            self.ref = mmodel.build_model(self.desc, self.family, mmodel.config_without_hooks(self.tconfig),
                                          self.spec, self.device).model
            for p in self.ref.parameters():
                p.requires_grad_(False)
        with torch.no_grad():
            for (n, p), (n2, q) in zip(self.bm.model.named_parameters(), self.ref.named_parameters()):
                assert n == n2, (n, n2)
                q.copy_(p)
        if self.cfg.trainer.ref_device == "cpu":
            self.ref.to("cpu")

    def _ref_on_device(self, module):
        if module is not self.ref or self.cfg.trainer.ref_device != "cpu" or self.device.type == "cpu":
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def ctx():
            self.ref.to(self.device)
            try:
                yield
            finally:
                self.ref.to("cpu")

        return ctx()

    # ----------------------------------------------------------------------------- training
    def _forward_backward(self, mini: TrainBatch, objective: Objective):
        def loss_fn(mb: MicroBatch, logits):
            lp, ent = self._token_values(logits, mb, objective.temperature, objective.entropy)
            return objective.loss(lp, ent, mb.batch)

        return self.schedule_backward(self.ddp, self.optimizer, mini, loss_fn)

    def schedule_backward(self, ddp, optimizer, mini: TrainBatch, loss_fn) -> dict:
        """Gradients of ``loss_fn(mb, logits) -> (loss, {metric: Stat})`` over ``mini`` (this DP rank's
        rows of a mini-batch) through megatron's schedule, for ``ddp`` (the policy's or the critic's)
        and its optimizer. Returns the statistics summed over the micro-batches on the device of the
        last stage (empty elsewhere); :meth:`_stats_to_host` reduces them once per call."""
        ddp.train()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out = self.run_schedule(ddp, self.micro_batches(mini), loss_fn, forward_only=False)
        total: dict = {}
        for d in out:
            total = merge(total, d)
        return total

    def _stats_to_host(self, stats, updates: int):
        """The base class's reduction on the last pipeline stage, over megatron's DP group (TP / CP
        peers computed the same statistics), one stacked tensor per reduction kind; then broadcast to
        the other stages (their keys once per call, with PP > 1) and copied to the host once, the copy
        overlapping the last optimizer step (:func:`~megaforge.trainer.metrics.to_host_later`)."""
        keys = self._obj_from_last_stage(sorted(stats) if self._last_stage() else None)
        if not keys:
            return dict
        vec = None
        if self._last_stage():
            group = self._ps().get_data_parallel_group()
            _, vec = stack_and_reduce(stats, updates, partial(_all_reduce, group=group))
        values = to_host_later(self._from_last_stage(vec, (len(keys),), torch.float64))
        return lambda: dict(zip(keys, values()))

    def init_critic(self) -> None:
        """A fresh critic (PPO / gae): the policy's current backbone with a zero value head
        (:mod:`megaforge.trainer.megatron.critic`), at the policy's layout."""
        self.critic = MegatronCritic(self)

    # ------------------------------------------------------------------- weights and state
    def iter_hf_buckets(self, max_bytes: int) -> Iterator[HFBucket]:
        return iter_hf_buckets(self.bm, max_bytes, merge=self.lora.merged if self.lora is not None else None)

    def iter_adapter_buckets(self, max_bytes: int) -> Iterator[HFBucket]:
        return lora_checkpoint.adapter_buckets(self, max_bytes)

    @onloaded
    def export_hf(self, path: str) -> None:
        export_hf(self.bm, self.hf_config, path, self.tokenizer, self.cfg.model.path,
                  merge=self.lora.merged if self.lora is not None else None)

    @onloaded
    def export_adapter(self, path: str) -> None:
        if self.lora is None:
            raise RuntimeError("export_adapter: model.lora is null (no adapters)")
        lora_checkpoint.export_adapter(self, path)

    def named_weights(self):
        critic = self.critic.bm.model if self.critic is not None else None
        return modules_weights(model=self.bm.model, ref=self.ref, critic=critic)

    @onloaded
    def save(self, path: str) -> None:
        self.check_finite()
        (lora_checkpoint.save if self.lora is not None else save)(self, path)

    @onloaded
    def load(self, path: str) -> None:
        (lora_checkpoint.load if self.lora is not None else load)(self, path)
        self._set_lr()

    def close(self) -> None:
        """Release megatron's parallel state (the process group stays); the trainer is unusable after."""
        self._ps().destroy_model_parallel()


def _all_reduce(vec: torch.Tensor, op: str, group) -> torch.Tensor:
    """``vec`` reduced in place by ``op`` ("sum" | "max") over ``group``."""
    dist.all_reduce(vec, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return vec


def _loss_wrapper(loss_fn, mb: MicroBatch, logits):
    """megatron loss-func protocol (loss, num_tokens, reduced dict); num_tokens is unused (1). The dict's
    tensors (forward only: per-row results) are detached; statistics
    (:class:`~megaforge.algorithms.stats.Stat`) are already."""
    with record_function("megaforge.loss"):
        loss, out = loss_fn(mb, logits)
    out = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()}
    return loss, torch.ones((), dtype=torch.int, device=logits.device), out
