"""Fused projection weights of the fast path: one GEMM for q, k, v and one for gate, up.

Per decoder layer (C hidden, H / Hkv query / key-value heads of D, F intermediate):

    qkv weight [H D + 2 Hkv D, C] = rows of q_proj | k_proj | v_proj   (bias [H D + 2 Hkv D] likewise, Qwen2)
    gate_up weight [2 F, C]       = rows of gate_proj | up_proj          (bias likewise, when present)

The fused tensors are the storage: each HF parameter's ``.data`` becomes its block of rows (a
contiguous view), so the Parameter objects keep their identity and every in-place write by HF name
(``param.data.copy_``: ``EmbeddedEngine.load_tensors``, the path of every weight update; an
optimizer step; the weight offloader, which frees and re-allocates a storage shared by several
tensors in place) lands in the fused tensor that the next step reads. HF's own modules still run on
the views (the simple loop, ``model.generate``). Fusing is idempotent: parameters that already are
consecutive row blocks of one storage (a second engine on the same model, a deep copy) are viewed,
not copied. A consequence: those parameters share one storage, which safetensors' writer refuses.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def _consecutive_rows(ts: Sequence[torch.Tensor]) -> bool:
    """Whether ``ts`` are contiguous, consecutive row blocks of one storage (same dtype and row shape)."""
    first = ts[0]
    off = first.storage_offset()
    for t in ts:
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not t.is_contiguous()
                or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or t.storage_offset() != off):
            return False
        off += t.numel()
    return True


def fuse_rows(params: Sequence[Optional[torch.Tensor]], what: str) -> Optional[torch.Tensor]:
    """The tensor [sum of rows, *row shape] whose consecutive row blocks are ``params``; afterwards
    each parameter views its block (see the module docstring). None when every entry is None (no
    bias); ``what`` names the tensors in the error for a partial set or mismatched rows."""
    if all(p is None for p in params):
        return None
    if any(p is None for p in params):
        raise ValueError(f"fast rollout path: {what}: some of the tensors are missing (biases on some projections only)")
    shapes = {(p.shape[1:], p.dtype, p.device) for p in params}
    if len(shapes) != 1:
        raise ValueError(f"fast rollout path: {what}: row shapes / dtypes / devices differ: {sorted(map(str, shapes))}")
    rows = sum(p.shape[0] for p in params)
    first = params[0]
    if not _consecutive_rows(params):
        with torch.no_grad():
            fused = torch.cat([p.detach() for p in params], 0)
        off = 0
        for p in params:
            n = p.shape[0]
            p.data = fused[off:off + n]
            off += n
    size = (rows, *first.shape[1:])
    stride = tuple(first.stride())
    return first.detach().as_strided(size, stride, first.storage_offset())


def fuse_layer(layer) -> dict:
    """The fused tensors of one HF decoder layer: ``qkv_w``, ``qkv_b`` (None without biases), ``gate_up_w``,
    ``gate_up_b`` (None without biases), and the row counts ``q``, ``kv``, ``ff``."""
    a, m = layer.self_attn, layer.mlp
    qkv = (a.q_proj, a.k_proj, a.v_proj)
    gu = (m.gate_proj, m.up_proj)
    return {"qkv_w": fuse_rows([p.weight for p in qkv], "q/k/v_proj.weight"),
            "qkv_b": fuse_rows([p.bias for p in qkv], "q/k/v_proj.bias"),
            "gate_up_w": fuse_rows([p.weight for p in gu], "gate/up_proj.weight"),
            "gate_up_b": fuse_rows([p.bias for p in gu], "gate/up_proj.bias"),
            "q": a.q_proj.weight.shape[0], "kv": a.k_proj.weight.shape[0], "ff": m.gate_proj.weight.shape[0]}
