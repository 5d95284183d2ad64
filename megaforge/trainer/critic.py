"""The PPO critic of the torch backend: a transformer backbone plus a linear value head.

Values are token-aligned like logprobs: ``values[b, t] = V(tokens[b, :t])``, the value of the state in
which token ``t`` is generated, read from the backbone's hidden state at position ``t - 1``; 0 at
``t = 0`` and on padding. The backbone is a copy of the policy's (at RL start, after the SFT warm
start) or ``critic.path``; the head starts at zero, so the first values are 0.

Training: the clipped value loss of :mod:`megaforge.algorithms.value` on ``batch.returns`` with
``batch.values`` as V_old, over the same mini-batches x epochs as the policy (the trainer's skeleton
runs :meth:`TorchCritic.forward_backward` and :meth:`TorchCritic.step`), its own AdamW (``critic.lr``)
and the trainer's gradient clip. Data parallel like the policy (:mod:`megaforge.trainer.torch_ddp`).
"""
from __future__ import annotations

import copy

import torch

from megaforge.algorithms.value import value_objective
from megaforge.hf import DTYPES
from megaforge.memory.state import grad_entries, optimizer_entries, param_entries
from megaforge.trainer import torch_ddp
from megaforge.trainer.base import Critic
from megaforge.trainer.logprobs import valid_positions
from megaforge.trainer.metrics import MEAN
from megaforge.trainer.precision import training_attention
from megaforge.types import TrainBatch


class ValueModel(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Token-aligned values [B, T] (float32)."""
        T = tokens.shape[1]
        attn = (torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]).long()
        with training_attention(tokens.device):  # cuDNN's attention backward can return NaN
            h = self.backbone(input_ids=tokens, attention_mask=attn, use_cache=False).last_hidden_state
        v = self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()
        out = torch.zeros_like(v)
        out[:, 1:] = v[:, :-1]
        return out * valid_positions(lengths, T)


def _backbone(critic, model, policy: torch.nn.Module, device) -> torch.nn.Module:
    if critic.path:
        from transformers import AutoModel

        return AutoModel.from_pretrained(critic.path, dtype=DTYPES[model.dtype],
                                         attn_implementation=model.attn_implementation,
                                         trust_remote_code=model.trust_remote_code).to(device)
    base = getattr(policy, "base_model", None)
    if base is None or base is policy:
        raise ValueError("critic: cannot find the policy's backbone (model.base_model); set critic.path")
    return copy.deepcopy(base).to(device)


class TorchCritic(Critic):
    """The torch backend's critic. Reads the ``critic`` section (``path``, ``lr``, ``value_clip``), the
    ``model`` section (loading a ``critic.path`` backbone) and the ``trainer`` section (micro-batches,
    gradient checkpointing, the optimizer's settings, ``grad_clip``)."""

    def __init__(self, critic, model, trainer, policy: torch.nn.Module, device: torch.device):
        self.critic_cfg, self.trainer_cfg, self.device = critic, trainer, device
        backbone = _backbone(critic, model, policy, device)
        hidden = backbone.config.hidden_size
        self.net = ValueModel(backbone, hidden).to(device)
        if trainer.gradient_checkpointing and hasattr(backbone, "gradient_checkpointing_enable"):
            backbone.gradient_checkpointing_enable()
        self.module = torch_ddp.wrap(self.net, device)
        self.opt = torch_ddp.adamw(self.net.parameters(), critic.lr, trainer)
        self.steps = 0

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Values on CPU (float32): [B, T] on every rank for a whole batch, [n, T] for a share (rows
        in the batch's order; computed in length-ordered micro-batches)."""
        self.net.eval()
        local = torch_ddp.rows_to_compute(batch)
        local_v = torch_ddp.per_row_results(local, self.trainer_cfg.micro_batch_size, batch.tokens.shape[1],
                                            lambda mb: self.net(mb.tokens.to(self.device), mb.lengths.to(self.device)),
                                            self.trainer_cfg.micro_batch_tokens)
        return torch_ddp.whole_or_share(local_v, batch)

    def forward_backward(self, mini: TrainBatch):
        self.net.train()
        clip = self.critic_cfg.value_clip

        def loss_fn(mb: TrainBatch):
            mb = mb.to(self.device)
            v = self.module(mb.tokens, mb.lengths)
            return value_objective(v, mb.values, mb.returns, mb.loss_mask, mb.num_tokens, clip)

        return torch_ddp.accumulate(self.module, mini, self.trainer_cfg.micro_batch_size, loss_fn,
                                    self.trainer_cfg.micro_batch_tokens)

    def step(self) -> dict[str, tuple[float, str]]:
        norm, stepped = torch_ddp.clipped_step(self.net.named_parameters(), self.opt, self.trainer_cfg.grad_clip)
        self.steps += int(stepped)
        return {"critic/grad_norm": (norm, MEAN)}

    def offload_entries(self, tags) -> list:
        if "state" not in tags:
            return []
        return param_entries(self.net, "state") + grad_entries(self.net) + optimizer_entries(self.opt)

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"model": self.net.state_dict(), "optimizer": self.opt.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
