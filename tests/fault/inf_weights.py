"""Fault injection (``--algo.plugins [inf_weights]``): after each optimizer step one element of the
policy's ``mlp.up_proj`` weight of layer 0 becomes inf, the way a numerical fault would leave it.
(With a finite learning rate AdamW's first update is at most lr per element, and a step with a
non-finite loss or gradient is skipped, so a run cannot get there on its own.)"""
import torch

from megaforge.trainer.torch_backend import TorchTrainer

_train_step = TorchTrainer.train_step


def _then_inf(self, batch):
    out = _train_step(self, batch)
    with torch.no_grad():
        dict(self.model.named_parameters())["model.layers.0.mlp.up_proj.weight"][0, 0] = float("inf")
    return out


TorchTrainer.train_step = _then_inf
