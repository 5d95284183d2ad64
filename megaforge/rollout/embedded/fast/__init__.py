"""The fast decode path of the embedded engine: static KV cache, continuous refill, CUDA graphs.

:class:`FastDecoder` serves :meth:`EmbeddedEngine.generate` when ``rollout.fast`` resolves on
(``auto``: on CUDA devices, for the model families :func:`supported` lists, from
megaforge.model_families); the simple HF DynamicCache loop stays the CPU default and the tests' oracle.
"""
from megaforge.rollout.embedded.fast.engine import FastDecoder, batch_bucket, kv_bucket, prefill_bucket
from megaforge.rollout.embedded.fast.forward import StaticForward, StaticKVCache, supported, unsupported_reason

__all__ = ["FastDecoder", "StaticForward", "StaticKVCache", "supported", "unsupported_reason",
           "batch_bucket", "kv_bucket", "prefill_bucket"]
