"""The engine interface every rollout backend implements (DESIGN.md, "Contracts").

Backends: ``embedded`` (HF transformers in-process), ``embedded_server`` / ``sglang`` (the same
client speaking SGLang's native HTTP API), ``megatron`` (megatron-core inference in the trainer).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable, Sequence

import torch

from megaforge.types import Completion, GenerateRequest

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class EngineStateError(RuntimeError):
    """A call the engine's state forbids: generating or loading weights while the weights are released,
    engines that serve different weight versions (every backend raises this one class)."""


class Engine(ABC):
    @abstractmethod
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        """Generate one completion per request, in request order, with per-token logprobs."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """Load HF-named tensors (bucket by bucket) and set the weight version."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently served."""

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free accelerator memory for ``tags`` (colocated mode)."""

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Re-allocate what :meth:`release_memory` freed."""

    def health(self) -> bool:
        """True when the engine can serve a generation."""
        return True

    def ensure_healthy(self) -> None:
        """Called by the loop at the start of every step (main rank): check the engine and bring a dead
        or hung one back (restart, weights re-synced to the served version, memory state restored), or
        raise naming it. Starts the step's restart budget. Default: nothing to check (in-process)."""

    def health_metrics(self) -> dict:
        """Health counters for the step's metrics (e.g. ``health/engine_restarts``); default none."""
        return {}

    def abort(self) -> None:
        """Abort all in-flight requests (they finish with reason ``abort``)."""

    def shutdown(self) -> None:
        """Stop the engine and free its resources."""


def check_tags(tags: Sequence[str]) -> list[str]:
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tag(s) {bad}; valid: {list(MEMORY_TAGS)}")
    return list(tags)
