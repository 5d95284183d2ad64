"""Trainer backends behind :class:`megaforge.trainer.base.Trainer`."""
from __future__ import annotations


def build_trainer(cfg, tokenizer=None):
    """The configured backend (``trainer.backend``), constructed on every rank."""
    if cfg.trainer.backend == "torch":
        from megaforge.trainer.torch_backend import TorchTrainer  # lazy: the chosen backend only

        return TorchTrainer(cfg, tokenizer)
    if cfg.trainer.backend == "megatron":
        try:
            from megaforge.trainer.megatron import MegatronTrainer  # lazy: megatron-core is optional
        except ImportError as e:
            raise RuntimeError(
                f"trainer.backend: megatron needs megatron-core (pip install 'megaforge[megatron]'): {e}"
            ) from e
        return MegatronTrainer(cfg, tokenizer)
    raise ValueError(f"unknown trainer.backend {cfg.trainer.backend!r}; valid: torch, megatron")
