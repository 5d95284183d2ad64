"""A policy loss plug-in that returns NaN (for the bad-step test)."""
import torch


def nan_loss(logprobs, old_logprobs, advantages, mask, p):
    return logprobs * float("nan"), {"clip_frac": torch.zeros_like(logprobs)}


CALLS = [0]


def nan_first_of_two(logprobs, old_logprobs, advantages, mask, p):
    """NaN on every other call: with trainer.mini_batches 2 and one micro-batch each, the first update
    of every step is skipped and the second is applied."""
    CALLS[0] += 1
    scale = float("nan") if CALLS[0] % 2 == 1 else 1.0
    ratio = torch.exp(logprobs - old_logprobs)
    return -(ratio * advantages) * scale, {"clip_frac": torch.zeros_like(logprobs)}
