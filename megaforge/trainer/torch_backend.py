"""The torch trainer backend: a Hugging Face CausalLM, AdamW, data parallelism through DDP.

Every rank receives the whole batch and trains on its contiguous share of each mini-batch. Losses
are contributions to the global objective (see megaforge.algorithms.aggregation), so gradients are
*summed* over ranks: DDP averages, hence the loss is multiplied by the world size.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
from typing import Iterator, Optional

import torch

from megaforge import dist
from megaforge.algorithms import ObjectiveParams, policy_objective
from megaforge.hf import hf_state_names, load_hf_model, resolve_device
from megaforge.memory import build_offloader, onloaded
from megaforge.checkpoint import write_torch
from megaforge.memory.state import torch_entries, torch_optimizers
from megaforge.trainer.base import HFBucket, StepMetrics, Trainer, modules_weights
from megaforge.trainer.logprobs import token_logprobs
from megaforge.trainer.optim import lr_at
from megaforge.types import TrainBatch


class TorchTrainer(Trainer):
    def __init__(self, cfg, tokenizer=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.device = resolve_device(cfg.trainer.device)
        self.model = load_hf_model(cfg.model, self.device)
        if cfg.trainer.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.module = self.model
        if dist.world() > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.module = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.params = ObjectiveParams.from_config(cfg)
        self.temperature = cfg.grpo.temperature
        self.ref: Optional[torch.nn.Module] = None
        self.critic = None  # megaforge.trainer.critic.TorchCritic when the run trains one (PPO)
        self.version = 0
        self.reset_optimizer(cfg.trainer.lr, cfg.max_steps * cfg.trainer.mini_batches * cfg.trainer.epochs,
                             cfg.trainer.warmup_steps, cfg.trainer.lr_schedule, cfg.trainer.min_lr)
        # memory.offload: pinned host buffers / torch_memory_saver (megaforge.memory); None: resident
        self._mem = build_offloader(cfg.memory.offload, self.device, self.offload_entries)

    # ------------------------------------------------------------------------------- optimizer

    def offload_entries(self, tags) -> list:
        return torch_entries(self, tags)

    def inner_optimizers(self) -> list:
        return torch_optimizers(self)

    def reset_optimizer(self, lr, total_steps, warmup_steps=0, schedule="constant", min_lr=0.0):
        t = self.cfg.trainer
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=tuple(t.betas), eps=t.eps,
                                     weight_decay=t.weight_decay)
        self.sched = dict(peak=lr, total=total_steps, warmup=warmup_steps, schedule=schedule, min_lr=min_lr, step=0)
        self._set_lr()

    def _set_lr(self) -> float:
        s = self.sched
        lr = lr_at(s["step"], s["peak"], s["total"], s["warmup"], s["schedule"], s["min_lr"])
        for g in self.opt.param_groups:
            g["lr"] = lr
        return lr

    def _optimizer_step(self) -> dict:
        clip = self.cfg.trainer.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params]))
        norm = float(norm)
        lr = self._set_lr()
        if not torch.isfinite(torch.tensor(norm)):
            self.opt.zero_grad(set_to_none=True)
            return {"grad_norm": norm, "lr": lr, "skipped": 1.0}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched["step"] += 1
        self.version += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # -------------------------------------------------------------------------------- forward
    def _forward(self, module, mb: TrainBatch, temperature: float, with_entropy: bool):
        mb = mb.to(self.device)
        T = mb.tokens.shape[1]
        attn = (torch.arange(T, device=self.device)[None, :] < mb.lengths[:, None]).long()
        logits = module(input_ids=mb.tokens, attention_mask=attn, use_cache=False).logits
        return token_logprobs(logits, mb.tokens, mb.lengths, temperature, with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: str = "policy") -> torch.Tensor:
        if model == "ref":
            if self.ref is None:
                raise RuntimeError("compute_logprobs(model='ref'): no reference model (snapshot_reference not called)")
            module = self.ref
        elif model == "policy":
            module = self.model
        else:
            raise ValueError(f"compute_logprobs: model must be 'policy' or 'ref', got {model!r}")
        lo, hi = dist.shard_range(batch.batch_size)
        local = batch.select(slice(lo, hi))
        ref_dev = next(module.parameters()).device
        parts = []
        for mb in local.micro_batches(self.cfg.trainer.micro_batch_size):
            if ref_dev != self.device:
                mb_ = mb.to(ref_dev)
                T = mb_.tokens.shape[1]
                attn = (torch.arange(T, device=ref_dev)[None, :] < mb_.lengths[:, None]).long()
                logits = module(input_ids=mb_.tokens, attention_mask=attn, use_cache=False).logits
                lp, _ = token_logprobs(logits, mb_.tokens, mb_.lengths, self.temperature)
            else:
                lp, _ = self._forward(module, mb, self.temperature, False)
            parts.append(torch.nn.functional.pad(lp.cpu(), (0, batch.tokens.shape[1] - lp.shape[1])))
        local_lp = torch.cat(parts) if parts else torch.zeros((0, batch.tokens.shape[1]))
        return dist.all_gather_rows(local_lp, batch.batch_size)

    @onloaded
    def init_critic(self) -> None:
        """A fresh critic (PPO / gae): copy of the current policy backbone (or critic.path), zero head."""
        from megaforge.trainer.critic import TorchCritic

        self.critic = TorchCritic(self.cfg, self.model, self.device)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values [B, T] (token-aligned, CPU, no gradient)."""
        if self.critic is None:
            raise RuntimeError("compute_values: no critic (init_critic not called; see critic.enabled)")
        return self.critic.compute_values(batch)

    @onloaded
    def snapshot_reference(self) -> None:
        dev = self.device if self.cfg.trainer.ref_device == "same" else resolve_device(self.cfg.trainer.ref_device)
        self.ref = copy.deepcopy(self.model).to(dev).eval()
        for p in self.ref.parameters():
            p.requires_grad_(False)

    # -------------------------------------------------------------------------------- training
    def _mini_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        m = self.cfg.trainer.mini_batches
        n = batch.batch_size
        if m > n:
            raise ValueError(f"trainer.mini_batches={m} exceeds the batch of {n} sequences")
        out = []
        for k in range(m):
            lo, hi = dist.shard_range(n, k, m)
            mini = batch.select(slice(lo, hi))
            mask = mini.loss_mask
            mini.num_tokens = int(mask.sum())
            mini.num_seqs = int((mask.sum(-1) > 0).sum())
            out.append(mini)
        return out

    def _run(self, batch: TrainBatch, loss_fn) -> dict[str, float]:
        """Mini-batches x epochs of optimizer steps; ``loss_fn(mb) -> (loss, metrics)``."""
        self.module.train()
        acc = StepMetrics()
        scale = float(dist.world())
        for _ in range(self.cfg.trainer.epochs):
            for mini in self._mini_batches(batch):
                if mini.num_tokens == 0:  # the same on every rank: all skip together
                    acc.add_empty()
                    continue
                lo, hi = dist.shard_range(mini.batch_size)
                local = mini.select(slice(lo, hi))
                if local.batch_size == 0:
                    raise ValueError(
                        f"a mini-batch of {mini.batch_size} sequences cannot feed {dist.world()} data-parallel "
                        "ranks: raise rollout.batch_size * grpo.n_samples or lower trainer.mini_batches")
                sums: dict[str, torch.Tensor] = {}
                mbs = list(local.micro_batches(self.cfg.trainer.micro_batch_size))
                for i, mb in enumerate(mbs):
                    sync = i == len(mbs) - 1 or not hasattr(self.module, "no_sync")
                    with (contextlib.nullcontext() if sync else self.module.no_sync()):
                        loss, metrics = loss_fn(mb)
                        (loss * scale).backward()
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + v.detach().float().cpu()
                keys = sorted(sums)
                vec = dist.all_reduce_sum(torch.stack([torch.as_tensor(sums[k]) for k in keys])) if keys else None
                step_metrics = {k: float(vec[i]) for i, k in enumerate(keys)} if keys else {}
                step_metrics.update(self._optimizer_step())
                acc.add(step_metrics)
        return acc.result()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        need_entropy = True

        def loss_fn(mb):
            lp, ent = self._forward(self.module, mb, self.temperature, need_entropy)
            if self.params.entropy_coef == 0.0 and ent is not None:
                ent = ent.detach()
            return policy_objective(lp, mb.to(self.device), self.params, ent)

        out = self._run(batch, loss_fn)
        if self.critic is not None and batch.returns is not None:
            out.update(self.critic.train_step(batch))
        return out

    def _forward_packed(self, module, mb: TrainBatch, temperature: float):
        """Token-aligned logprobs [B, T] of ``mb``'s rows, computed on packed rows (several rows per
        packed row, position ids restarting per row, attention within a row only)."""
        from megaforge.data.packing import pack_rows

        pk = pack_rows(mb.tokens, mb.lengths, self.cfg.sft.pack_len)
        tokens, pos = pk.tokens.to(self.device), pk.position_ids.to(self.device)
        # no attention_mask: transformers derives the block-diagonal causal mask from the restarts
        logits = module(input_ids=tokens, position_ids=pos, use_cache=False).logits
        full = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=self.device)
        lp, _ = token_logprobs(logits, tokens, full, temperature)
        return pk.unpack(lp * (pos >= 1).float())

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        def loss_fn(mb):
            if self.cfg.sft.pack:
                lp = self._forward_packed(self.module, mb, 1.0)
            else:
                lp, _ = self._forward(self.module, mb, 1.0, False)
            mask = mb.loss_mask.to(self.device)
            loss = -(lp * mask).sum() / mb.num_tokens
            return loss, {"loss": loss.detach()}

        return self._run(batch, loss_fn)

    # --------------------------------------------------------------------------------- weights
    def iter_hf_buckets(self, max_bytes: int) -> Iterator[HFBucket]:
        if not self.is_engine_feeder:
            return
        sd = self.model.state_dict()
        bucket: HFBucket = []
        size = 0
        for name in hf_state_names(self.model):
            t = sd[name].detach()
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > max_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
        if bucket:
            yield bucket

    # ------------------------------------------------------------------------------ checkpoint
    def named_weights(self):
        critic = self.critic.net if self.critic is not None else None
        return modules_weights(model=self.model, ref=self.ref, critic=critic)

    @onloaded
    def save(self, path: str) -> None:
        self.check_finite()
        if dist.is_main():
            os.makedirs(path, exist_ok=True)
            state = {"model": self.model.state_dict(), "version": self.version, "sched": dict(self.sched)}
            if self.cfg.checkpoint.save_optimizer:
                state["optimizer"] = self.opt.state_dict()
            if self.ref is not None:
                state["ref"] = self.ref.state_dict()
            if self.critic is not None:
                state["critic"] = self.critic.state_dict()
            write_torch(state, os.path.join(path, "trainer.pt"))
        dist.barrier()

    @onloaded
    def load(self, path: str) -> None:
        f = os.path.join(path, "trainer.pt")
        state = torch.load(f, map_location="cpu", weights_only=True)
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise RuntimeError(f"{f}: the saved model does not match the configured one: {e}") from e
        self.version = int(state["version"])
        self.sched = dict(state["sched"])
        if "optimizer" in state:
            self.opt.load_state_dict(state["optimizer"])
        if "ref" in state:
            self.snapshot_reference()
            self.ref.load_state_dict(state["ref"])
        if "critic" in state:
            self.init_critic()
            self.critic.load_state_dict(state["critic"])
        self._set_lr()

    #: largest safetensors shard of :meth:`export_hf` (bigger models get model-0000i-of-N + index)
    export_max_shard_bytes: int = 5 * 10**9

    @onloaded
    def export_hf(self, path: str) -> None:
        """transformers' ``save_pretrained`` (it splits fused MoE experts back into the per-expert
        tensors of Hub checkpoints), sharded with an index above ``export_max_shard_bytes``, plus
        the tokenizer; written to a temporary folder next to ``path`` and renamed, removed on
        failure (:func:`megaforge.convert.hf_writer.atomic_output_dir`, shared with the megatron
        backend's writer)."""
        if dist.is_main():
            from megaforge.convert.hf_writer import atomic_output_dir

            with atomic_output_dir(path) as tmp:
                self.model.save_pretrained(tmp, safe_serialization=True, max_shard_size=self.export_max_shard_bytes)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(tmp)
        dist.barrier()
