"""The PPO critic of the torch backend: a transformer backbone plus a linear value head.

Values are token-aligned like logprobs: ``values[b, t] = V(tokens[b, :t])``, the value of the state in
which token ``t`` is generated, read from the backbone's hidden state at position ``t - 1``; 0 at
``t = 0`` and on padding. The backbone is a copy of the policy's (at RL start, after the SFT warm
start) or ``critic.path``; the head starts at zero, so the first values are 0.

Training: the clipped value loss of :mod:`megaforge.algorithms.value` on ``batch.returns`` with
``batch.values`` as V_old, over the same mini-batches x epochs as the policy, its own AdamW
(``critic.lr``) and the trainer's gradient clip. Data parallel like the policy (DDP, loss x world).
"""
from __future__ import annotations

import contextlib
import copy

import torch

from megaforge import dist
from megaforge.algorithms.value import value_objective
from megaforge.trainer.logprobs import valid_positions
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
        h = self.backbone(input_ids=tokens, attention_mask=attn, use_cache=False).last_hidden_state
        v = self.head(h.to(self.head.weight.dtype)).squeeze(-1).float()
        out = torch.zeros_like(v)
        out[:, 1:] = v[:, :-1]
        return out * valid_positions(lengths, T)


def _backbone(cfg, policy: torch.nn.Module, device) -> torch.nn.Module:
    if cfg.critic.path:
        from transformers import AutoModel

        from megaforge.hf import DTYPES

        return AutoModel.from_pretrained(cfg.critic.path, dtype=DTYPES[cfg.model.dtype],
                                         attn_implementation=cfg.model.attn_implementation,
                                         trust_remote_code=cfg.model.trust_remote_code).to(device)
    base = getattr(policy, "base_model", None)
    if base is None or base is policy:
        raise ValueError("critic: cannot find the policy's backbone (model.base_model); set critic.path")
    return copy.deepcopy(base).to(device)


class TorchCritic:
    def __init__(self, cfg, policy: torch.nn.Module, device: torch.device):
        self.cfg, self.device = cfg, device
        backbone = _backbone(cfg, policy, device)
        hidden = backbone.config.hidden_size
        self.net = ValueModel(backbone, hidden).to(device)
        if cfg.trainer.gradient_checkpointing and hasattr(backbone, "gradient_checkpointing_enable"):
            backbone.gradient_checkpointing_enable()
        self.module = self.net
        if dist.world() > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.module = torch.nn.parallel.DistributedDataParallel(self.net, device_ids=ids)
        t = cfg.trainer
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=cfg.critic.lr, betas=tuple(t.betas), eps=t.eps,
                                     weight_decay=t.weight_decay)
        self.steps = 0

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Values [B, T] on CPU (float32), every rank gets the whole batch's."""
        self.net.eval()
        lo, hi = dist.shard_range(batch.batch_size)
        local = batch.select(slice(lo, hi))
        parts = []
        for mb in local.micro_batches(self.cfg.trainer.micro_batch_size):
            v = self.net(mb.tokens.to(self.device), mb.lengths.to(self.device))
            parts.append(torch.nn.functional.pad(v.cpu(), (0, batch.tokens.shape[1] - v.shape[1])))
        local_v = torch.cat(parts) if parts else torch.zeros((0, batch.tokens.shape[1]))
        return dist.all_gather_rows(local_v, batch.batch_size)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Value-loss updates on ``batch`` (needs ``values`` = V_old and ``returns``)."""
        if batch.values is None or batch.returns is None:
            raise ValueError("critic.train_step: the batch needs values (V_old) and returns")
        self.net.train()
        m = self.cfg.trainer.mini_batches
        scale = float(dist.world())
        totals: dict[str, float] = {}
        n_updates = 0
        for _ in range(self.cfg.trainer.epochs):
            for k in range(m):
                lo, hi = dist.shard_range(batch.batch_size, k, m)
                mini = batch.select(slice(lo, hi))
                n_tok = int(mini.loss_mask.sum())
                if n_tok == 0:
                    continue
                a, b = dist.shard_range(mini.batch_size)
                local = mini.select(slice(a, b))
                mbs = list(local.micro_batches(self.cfg.trainer.micro_batch_size))
                sums: dict[str, torch.Tensor] = {}
                for i, mb in enumerate(mbs):
                    sync = i == len(mbs) - 1 or not hasattr(self.module, "no_sync")
                    with (contextlib.nullcontext() if sync else self.module.no_sync()):
                        v = self.module(mb.tokens.to(self.device), mb.lengths.to(self.device))
                        loss, met = value_objective(v, mb.values.to(self.device), mb.returns.to(self.device),
                                                    mb.loss_mask.to(self.device), n_tok, self.cfg.critic.value_clip)
                        (loss * scale).backward()
                    for key, val in met.items():
                        sums[key] = sums.get(key, 0.0) + val.detach().float().cpu()
                keys = sorted(sums)
                vec = dist.all_reduce_sum(torch.stack([torch.as_tensor(sums[key]) for key in keys]))
                for i, key in enumerate(keys):
                    totals[key] = totals.get(key, 0.0) + float(vec[i])
                totals["critic/grad_norm"] = totals.get("critic/grad_norm", 0.0) + self._optimizer_step()
                n_updates += 1
        return {k: v / max(n_updates, 1) for k, v in totals.items()}

    def _optimizer_step(self) -> float:
        params = [p for p in self.net.parameters() if p.grad is not None]
        clip = self.cfg.trainer.grad_clip
        if clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])))
        if torch.isfinite(torch.tensor(norm)):
            self.opt.step()
            self.steps += 1
        self.opt.zero_grad(set_to_none=True)
        return norm

    # ------------------------------------------------------------------ state and placement
    def state_dict(self) -> dict:
        return {"model": self.net.state_dict(), "optimizer": self.opt.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def to(self, device) -> None:
        self.net.to(device)
        for st in self.opt.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    st[k] = v.to(device)
