"""The torch trainer backend: a Hugging Face CausalLM, AdamW, data parallelism through DDP
(:mod:`megaforge.trainer.torch_ddp`: every rank trains on its contiguous share of each mini-batch,
gradients summed over ranks). The training skeleton is :class:`megaforge.trainer.base.Trainer`'s.

With ``model.lora`` (:mod:`megaforge.trainer.lora`, PEFT): the base weights are frozen and stay on
the device (nothing is offloaded and reloaded for them beyond what ``memory.offload`` asks); AdamW
holds the adapters alone; the reference policy (``grpo.beta`` > 0) is the same model with its
adapters disabled (no second copy of the base; after a LoRA SFT warm start, the same base with a
frozen copy of the warm-started adapters swapped in); the engines get the merged weights; checkpoints
hold the adapters, their optimizer state and the reference adapters (if any), not the base.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Iterator

import torch

from megaforge import collective
from megaforge.checkpoint import write_torch
from megaforge.convert.hf_writer import atomic_output_dir
from megaforge.data.packing import pack_rows
from megaforge.hf import hf_state_names, load_hf_model, resolve_device
from megaforge.memory import build_offloader, onloaded
from megaforge.memory.state import grad_entries, on_device, optimizer_entries, param_entries
from megaforge.specs import TrainerSpec
from megaforge.trainer import precision, torch_ddp
from megaforge.trainer.base import HFBucket, Objective, Trainer, modules_weights
from megaforge.trainer.causal_lm import POSITIONS, CausalLMLogprobs, check_split_head
from megaforge.trainer.critic import TorchCritic
from megaforge.trainer.logprobs import trained_positions
from megaforge.sync.adapters import byte_buckets, pair_buckets
from megaforge.trainer.lora import LoraPolicy
from megaforge.trainer.teacher import load_torch_teacher
from megaforge.types import TrainBatch


class TorchTrainer(Trainer):
    def __init__(self, spec: TrainerSpec, tokenizer=None):
        super().__init__(spec, tokenizer)
        cfg, t = self.cfg, spec.trainer
        self.device = resolve_device(t.device)
        self.model = load_hf_model(cfg.model, self.device)
        if t.autocast != "off":
            precision.float32_head(self.model)
        if t.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if t.head_positions == "trained":
            check_split_head(self.model)
        self.lora = None  # LoraPolicy with model.lora; self.model is then adapted in place
        self._lora_ref = False  # the reference is the LoRA base (adapters off or swapped)
        self._ref_adapters = None  # the reference's frozen adapters (after a LoRA warm start), else None
        if cfg.model.lora is not None:
            self.lora = LoraPolicy(self.model, cfg.model.lora, cfg.model.path)
            if t.gradient_checkpointing:  # frozen embeddings: the checkpointed blocks need an input that wants grad
                self.model.enable_input_require_grads()
        # the training forward, under DDP with several ranks; self.model stays the HF CausalLM
        self.module = torch_ddp.wrap(CausalLMLogprobs(self.model, t.autocast), self.device)
        self.opt = torch_ddp.adamw([p for p in self.model.parameters() if p.requires_grad], t.lr, t)
        self.reset_optimizer(t.lr, cfg.max_steps * t.mini_batches * t.epochs, t.warmup_steps, t.lr_schedule, t.min_lr)
        if cfg.teacher.path and cfg.teacher.served_by == "trainer":  # distillation: frozen, on the trainer's device
            self.teacher = load_torch_teacher(cfg.teacher, cfg.model, self.device, tokenizer)
            if t.autocast != "off":
                precision.float32_head(self.teacher)
        # memory.offload: pinned host buffers / torch_memory_saver (megaforge.memory); None: resident
        self._mem = build_offloader(cfg.memory.offload, self.device, self.offload_entries)

    def _clear_grads(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------- optimizer
    def offload_entries(self, tags) -> list:
        """Parameters (``weights``); gradients, AdamW state, reference, teacher, critic (``state``)."""
        out = param_entries(self.model, "weights") if "weights" in tags else []
        if "state" in tags:
            out += grad_entries(self.model) + optimizer_entries(self.opt)
            if self.ref is not None:
                out += param_entries(self.ref, "state")
            if self.teacher is not None:
                out += param_entries(self.teacher, "state")
            if self.critic is not None:
                out += self.critic.offload_entries(tags)
        return on_device(out, self.device)

    def inner_optimizers(self) -> list:
        return [self.opt] + ([self.critic.opt] if self.critic is not None else [])

    def _clear_optimizer_state(self) -> None:
        self.opt.state.clear()

    def _apply_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def _clip_and_step(self) -> tuple[float, bool]:
        return torch_ddp.clipped_step(self.model.named_parameters(), self.opt, self.cfg.trainer.grad_clip)

    # -------------------------------------------------------------------------------- forward
    def _logprobs(self, module, mb: TrainBatch, temperature: float, with_entropy: bool, trained: bool):
        """(logprobs, entropy) of ``mb`` by ``module`` (a :class:`CausalLMLogprobs`, DDP-wrapped or not)
        on the module's device: at the trained positions only (0 elsewhere) when ``trained``, else at
        every position 1 <= t < length. The head runs on the trained positions alone when
        ``trainer.head_positions`` is "trained" (those positions found on the host: ``mb`` is there);
        with "all" every position's is computed and masked."""
        select = trained and self.cfg.trainer.head_positions == "trained"
        positions = trained_positions(mb.loss_mask, mb.lengths) if select else None
        mb = mb.to(next(module.parameters()).device)
        lp, ent = module(mb.tokens, mb.lengths, temperature, with_entropy, positions=positions)
        if trained and not select:
            keep = (mb.loss_mask > 0).float()
            lp, ent = lp * keep, (None if ent is None else ent * keep)
        return lp, ent

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: str = "policy", positions: str = "all") -> torch.Tensor:
        """See :meth:`Trainer.compute_logprobs`; computed in length-ordered micro-batches
        (:func:`megaforge.trainer.torch_ddp.per_row_results`), returned in the batch's row order."""
        if positions not in POSITIONS:
            raise ValueError(f"compute_logprobs: positions must be one of {POSITIONS}, got {positions!r}")
        lora_ref = model == "ref" and self._lora_ref
        module = CausalLMLogprobs(self.model if lora_ref else self._select_model(model, self.model),
                                  self.cfg.trainer.autocast)
        local = torch_ddp.rows_to_compute(batch)
        with (self.lora.adapters(self._ref_adapters) if lora_ref else contextlib.nullcontext()):
            local_lp = torch_ddp.per_row_results(
                local, self.cfg.trainer.micro_batch_size, batch.tokens.shape[1],
                lambda mb: self._logprobs(module, mb, self.temperature, False, positions == "trained")[0],
                self.cfg.trainer.micro_batch_tokens)
        return torch_ddp.whole_or_share(local_lp, batch)

    @onloaded
    def init_critic(self) -> None:
        """A fresh critic (PPO / gae): copy of the current policy backbone (or critic.path), zero head."""
        c = self.cfg
        self.critic = TorchCritic(c.critic, c.model, c.trainer, self.model, self.device)

    @onloaded
    def snapshot_reference(self) -> None:
        if self.lora is not None:  # the base itself (adapters off), or it with the adapters of now
            self._lora_ref = True
            self._ref_adapters = None if self.lora.fresh() else {
                n: t.clone() for n, t in self.lora.adapter_state().items()}
            return
        dev = self.device if self.cfg.trainer.ref_device == "same" else resolve_device(self.cfg.trainer.ref_device)
        self.ref = copy.deepcopy(self.model).to(dev).eval()
        for p in self.ref.parameters():
            p.requires_grad_(False)
        if self.cfg.trainer.autocast != "off":  # bound to the copy's own head (not the policy's)
            precision.float32_head(self.ref)

    # -------------------------------------------------------------------------------- training
    def _forward_backward(self, mini: TrainBatch, objective: Objective):
        self.module.train()
        packed = objective.packed and self.cfg.sft.pack

        def loss_fn(mb: TrainBatch):
            if packed:
                lp, ent = self._forward_packed(self.module, mb, objective.temperature), None
            else:
                lp, ent = self._logprobs(self.module, mb, objective.temperature, objective.entropy,
                                         objective.trained_positions)
            return objective.loss(lp, ent, mb.to(self.device))

        return torch_ddp.accumulate(self.module, mini, self.cfg.trainer.micro_batch_size, loss_fn,
                                    self.cfg.trainer.micro_batch_tokens)

    def _forward_packed(self, module, mb: TrainBatch, temperature: float):
        """Token-aligned logprobs [B, T] of ``mb``'s rows, computed on packed rows (several rows per
        packed row, position ids restarting per row, attention within a row only), every position."""
        pk = pack_rows(mb.tokens, mb.lengths, self.cfg.sft.pack_len)
        tokens, pos = pk.tokens.to(self.device), pk.position_ids.to(self.device)
        full = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=self.device)
        lp, _ = module(tokens, full, temperature, False, position_ids=pos)
        return pk.unpack(lp * (pos >= 1).float())

    # --------------------------------------------------------------------------------- weights
    def iter_hf_buckets(self, max_bytes: int) -> Iterator[HFBucket]:
        if not self.is_engine_feeder:
            return
        if self.lora is not None:  # merged W + s B A under the base's names, one tensor at a time
            tensors = self.lora.merged_state(hf_state_names(self.model, [n for n, _ in self.lora.base_state()]))
        else:
            sd = self.model.state_dict()
            tensors = ((name, sd[name]) for name in hf_state_names(self.model))
        yield from byte_buckets(([(name, t.detach())] for name, t in tensors), max_bytes)

    def iter_adapter_buckets(self, max_bytes: int) -> Iterator[HFBucket]:
        """The LoRA adapters as ``[(M.lora_A.weight, A), (M.lora_B.weight, B), ...]`` buckets of at most
        ``max_bytes`` (an A/B pair never split), for :func:`megaforge.sync.adapters.push_adapters`."""
        if not self.is_engine_feeder or self.lora is None:
            return
        yield from pair_buckets(self.lora.adapter_tensors(), max_bytes)

    # ------------------------------------------------------------------------------ checkpoint
    def named_weights(self):
        critic = self.critic.net if self.critic is not None else None
        return modules_weights(model=self.model, ref=self.ref, critic=critic)

    @onloaded
    def save(self, path: str) -> None:
        self.check_finite()
        if collective.is_main():
            os.makedirs(path, exist_ok=True)
            state = {"version": self.version, "sched": dict(self.sched)}
            if self.lora is not None:  # the adapters (and the reference's), not the frozen base
                state["lora"] = self.lora.adapter_state()
                if self._lora_ref:
                    state["lora_ref"] = self._ref_adapters if self._ref_adapters is not None else {}
            else:
                state["model"] = self.model.state_dict()
            if self.cfg.checkpoint.save_optimizer:
                state["optimizer"] = self.opt.state_dict()
            if self.ref is not None:
                state["ref"] = self.ref.state_dict()
            if self.critic is not None:
                state["critic"] = self.critic.state_dict()
            write_torch(state, os.path.join(path, "trainer.pt"))
        collective.barrier()

    @onloaded
    def load(self, path: str) -> None:
        f = os.path.join(path, "trainer.pt")
        state = torch.load(f, map_location="cpu", weights_only=True)
        if ("lora" in state) != (self.lora is not None):
            raise RuntimeError(f"{f}: the checkpoint holds {'LoRA adapters' if 'lora' in state else 'full weights'} "
                               f"but model.lora is {'set' if self.lora is not None else 'null'}: resume with the "
                               f"model.lora of the run that wrote it")
        if self.lora is not None:
            self.lora.load_adapter_state(state["lora"], f)
            if "lora_ref" in state:
                self._lora_ref, self._ref_adapters = True, (state["lora_ref"] or None)
        else:
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
        if collective.is_main():
            with atomic_output_dir(path) as tmp:
                model = self.model if self.lora is None else self._merged_model()
                model.save_pretrained(tmp, safe_serialization=True, max_shard_size=self.export_max_shard_bytes)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(tmp)
        collective.barrier()

    def _merged_model(self):
        """A plain HF CausalLM (no PEFT layers) holding the merged weights W + s B A (LoRA export)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(self.model.config, dtype=next(self.model.parameters()).dtype)
        merged = dict(self.lora.merged_state([n for n, _ in self.lora.base_state()]))
        plain.load_state_dict({n: t.detach().clone() for n, t in merged.items()}, strict=True, assign=True)
        plain.tie_weights()  # assign=True gave lm_head its own tensor: tied again, save_pretrained writes it once
        return plain

    @onloaded
    def export_adapter(self, path: str) -> None:
        """The LoRA adapters as a PEFT adapter folder (``peft.PeftModel.from_pretrained(base, path)``),
        written to a temporary folder next to ``path`` and renamed."""
        if self.lora is None:
            raise RuntimeError("export_adapter: model.lora is null (no adapters)")
        if collective.is_main():
            with atomic_output_dir(path) as tmp:
                self.lora.save_adapter(tmp)
        collective.barrier()
