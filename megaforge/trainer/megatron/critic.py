"""The PPO critic of the Megatron backend: the policy's GPTModel backbone with a value head.

Same semantics as :class:`megaforge.trainer.critic.TorchCritic`: token-aligned values
``values[b, t] = V(tokens[b, :t])`` read from the final hidden state at position ``t - 1`` (0 at
``t = 0`` and on padding), the clipped value loss of :mod:`megaforge.algorithms.value` on
``batch.returns`` with ``batch.values`` as V_old, the same mini-batches x epochs as the policy, its
own Adam(W) at the constant ``critic.lr`` with the trainer's gradient clip and weight decay.

Model: a second GPTModel at the policy's layout (TP x PP x CP x DP, same layer spec), untied, whose
``output_layer`` is a :class:`ValueHead`: a [H -> 1] linear layer, zero at the start (first values
are 0), *replicated* over the TP ranks. Under sequence parallelism its input (this rank's share of
the sequence) is all-gathered first; every TP rank then computes the same values, so the gather's
backward only splits the gradient (no reduction) and the head's gradient is already complete on
each rank (megatron counts a replicated parameter once in the gradient norm). The backbone starts
as a copy of the policy's current weights (after the SFT warm start). ``critic.path`` (another
backbone) is a torch-backend option.

Calling it: collective like the trainer; the trainer's ``train_step`` updates it after the policy
when the batch has returns (the skeleton of :mod:`megaforge.trainer.base` drives
:meth:`MegatronCritic.forward_backward` and :meth:`MegatronCritic.step`); checkpoints hold the critic and its optimizer under
``critic.`` / ``critic_optimizer`` keys (:mod:`megaforge.trainer.megatron.checkpoint`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.profiler import record_function

from megaforge.algorithms.value import value_objective
from megaforge.memory.state import ddp_entries
from megaforge.trainer.base import Critic
from megaforge.trainer.megatron import model as mmodel
from megaforge.trainer.megatron.optim import adam_optimizer, clipped_step, finalize_grads, set_lr_and_decay, wrap_ddp
from megaforge.trainer.metrics import MEAN
from megaforge.types import TrainBatch


def _value_head_class():
    from megatron.core.transformer.module import MegatronModule

    class ValueHead(MegatronModule):
        """Drop-in for GPTModel's ``output_layer``: hidden [s_local, b, H] -> (values [s, b, 1], None)."""

        def __init__(self, config, hidden: int):
            super().__init__(config)
            self.sequence_parallel = bool(config.sequence_parallel)
            # named like the output layer's (megatron's state dict hooks look for output_layer.weight)
            self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=config.params_dtype))
            self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))

        def forward(self, hidden, weight=None, runtime_gather_output=None):
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            if self.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            return torch.nn.functional.linear(hidden, self.weight, self.bias), None

    return ValueHead


class MegatronCritic(Critic):
    def __init__(self, tr):

        cfg, t = tr.cfg, tr.cfg.trainer
        if cfg.critic.path:
            raise ValueError("critic.path: trainer.backend megatron starts the critic from the policy's backbone; "
                             "leave critic.path empty (or use trainer.backend torch for another backbone)")
        self.tr, self.cfg = tr, cfg
        self.tconfig = mmodel.config_without_hooks(tr.tconfig)
        desc = dataclasses.replace(tr.desc, tied=False)  # the output layer is replaced: nothing to tie
        self.bm = mmodel.build_model(desc, tr.family, self.tconfig, tr.spec, tr.device)
        model = self.bm.model
        if model.post_process:
            model.output_layer = _value_head_class()(self.tconfig, desc.hidden).to(tr.device)
        src = dict(tr.bm.model.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("output_layer."):
                    continue
                if name not in src or src[name].shape != p.shape:
                    raise RuntimeError(f"critic: policy has no parameter {name} of shape {tuple(p.shape)}")
                p.copy_(src[name])
        self.ddp = wrap_ddp(self.tconfig, model, t.distributed_optimizer)
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.tconfig.finalize_model_grads_func = finalize_grads
        self.optimizer = adam_optimizer(t, self.ddp, tr.dtype, cfg.critic.lr)
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.steps = 0

    def _values(self, logits: torch.Tensor, mb) -> torch.Tensor:
        """Token-aligned values [b, T] (float32) from the head's output [1, t_local, 1]."""
        return mb.packed.to_rows(self.tr.cp_gather(logits[0, :, 0].float()))

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Values on CPU (float32): the whole batch's [B, T] on every rank, or a share's [n, T] rows."""
        tr = self.tr
        B, T = batch.tokens.shape
        self.ddp.eval()
        local = tr.dp_rows(batch)
        out = tr.run_schedule(self.ddp, tr.micro_batches(local),
                           lambda mb, v: (v.sum() * 0.0, {"values": self._values(v, mb)}), forward_only=True)
        return tr.gather_rows(out, "values", local.batch_size, B, T, torch.float32, across_dp=not batch.is_share)

    def forward_backward(self, mini: TrainBatch):
        clip = self.cfg.critic.value_clip

        def loss_fn(mb, v):
            b = mb.batch
            return value_objective(self._values(v, mb), b.values, b.returns, b.loss_mask, b.num_tokens, clip)

        return self.tr.schedule_backward(self.ddp, self.optimizer, mini, loss_fn)

    def step(self) -> dict[str, tuple[float, str]]:
        set_lr_and_decay(self.optimizer, self.cfg.critic.lr, self.cfg.trainer.weight_decay)  # constant critic.lr
        with record_function("megaforge.optimizer_step"):
            norm, stepped = clipped_step(self.optimizer, self.cfg.trainer.grad_clip)
        self.steps += int(stepped)
        return {"critic/grad_norm": (norm, MEAN)}

    def offload_entries(self, tags) -> list:
        """The critic's DDP buffers (weights and gradients, both ``state``) and optimizer tensors."""
        return ddp_entries(self.ddp, self.optimizer, tags, weights_tag="state")
