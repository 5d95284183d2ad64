"""Learning-rate schedules (shared by the backends) as a multiplier of the peak LR.

    warm-up (s < W):  lr(s) = peak * (s + 1) / W
    constant:         lr(s) = peak
    linear:           lr(s) = min_lr + (peak - min_lr) * (1 - f)
    cosine:           lr(s) = min_lr + (peak - min_lr) * (1 + cos(pi f)) / 2
    with f = clamp((s - W) / max(1, total - W), 0, 1)
"""
from __future__ import annotations

import math


def lr_at(step: int, peak: float, total: int, warmup: int = 0, schedule: str = "constant", min_lr: float = 0.0) -> float:
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    f = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    if schedule == "linear":
        return min_lr + (peak - min_lr) * (1.0 - f)
    if schedule == "cosine":
        return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * f))
    raise ValueError(f"unknown lr schedule {schedule!r}; valid: constant, linear, cosine")
