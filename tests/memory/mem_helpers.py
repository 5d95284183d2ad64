"""Helpers of the offload tests: a TrainBatch, trainer configs, snapshots of every offloaded tensor."""
from __future__ import annotations

import torch


def make_batch(vocab: int, B: int = 4, T: int = 12, seed: int = 0):
    """A right-padded RL TrainBatch with random advantages (loss on every token after the first two)."""
    from megaforge.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 7, 10, 5][:B])
    t = torch.arange(T)[None]
    tokens = torch.where(t < lengths[:, None], torch.randint(3, vocab, (B, T), generator=g), 0)
    mask = ((t >= 2) & (t < lengths[:, None])).float()
    adv = torch.randn(B, generator=g)[:, None].expand(B, T) * mask
    lp = (-5.0 + 0.3 * torch.randn(B, T, generator=g)) * mask
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=adv.contiguous(), rollout_logprobs=lp,
                      num_tokens=int(mask.sum()), num_seqs=int((mask.sum(-1) > 0).sum()))


def torch_trainer_cfg(model_dir: str, **over):
    from megaforge.config import config_from_dict

    d = {"model": {"path": model_dir, "dtype": "float32"}, "max_steps": 4, "seed": 0,
         "data": {"path": "arithmetic", "format": "synthetic"},
         "trainer": {"backend": "torch", "device": "cpu", "lr": 1e-2, "micro_batch_size": 2, "grad_clip": 1.0},
         "grpo": {"beta": 0.01}}
    for k, v in over.items():
        sec, key = k.split(".")
        d.setdefault(sec, {})[key] = v
    return config_from_dict(d)


def snapshot(entries) -> dict:
    """{id(tensor): (tensor, values)} of entries (values cloned)."""
    return {id(e.tensor): (e.tensor, e.tensor.detach().clone()) for e in entries}


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
