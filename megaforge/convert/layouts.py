"""Tensor layouts between Hugging Face and Megatron-Core, and their tensor-parallel split / merge.

Pure functions on CPU tensors; no process groups. A *layout* turns the HF tensors of one Megatron
parameter into the full (unsharded) Megatron tensor and back, and splits that full tensor into TP
shards and merges them again. Layouts are registered by name in :data:`LAYOUTS`; a family's mapping
table (:mod:`megaforge.convert.families`) names one per parameter. New layouts (e.g. MoE experts)
register here without touching the callers.

Shapes (``H`` hidden, ``nq``/``nkv`` query / key-value heads, ``d`` head dim, ``F`` FFN size,
``V`` vocabulary, ``Vp`` padded vocabulary, ``tp`` tensor-parallel size):

* ``replicated``: same tensor on every TP rank (norm weights).
* ``column``: split along dim 0 (output features).
* ``row``: split along dim 1 (input features; ``o_proj``, ``down_proj``).
* ``qkv``: HF q [nq*d, ...], k [nkv*d, ...], v [nkv*d, ...] -> Megatron's fused tensor laid out per
  key/value group g as [q heads of g (nq/nkv * d rows) | k_g (d) | v_g (d)], shape
  [(nq + 2 nkv) d, ...]; weights and biases alike. Groups are contiguous, so a dim-0 split gives each
  TP rank nkv/tp whole groups (requires nkv % tp == 0).
* ``gate_up``: HF gate [F, H], up [F, H] -> [2F, H] = cat(gate, up); the TP shard of rank r is
  cat(gate_r, up_r) (each half split separately), so merging splits every shard in halves.
* ``vocab``: HF [V, H] -> [Vp, H] with zero rows appended (Megatron pads the vocabulary to a
  multiple of ``make_vocab_size_divisible_by * tp``); split along dim 0; the padding is removed when
  converting back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class Dims:
    """The model sizes a layout needs."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Smallest multiple of ``divisible_by * tp`` that is >= ``vocab`` (Megatron's rule)."""
    m = divisible_by * tp
    return ((vocab + m - 1) // m) * m


def _check(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


def _split(x: torch.Tensor, dim: int, tp: int, rank: int, what: str) -> torch.Tensor:
    _check(x.shape[dim] % tp == 0, f"{what}: dim {dim} of shape {tuple(x.shape)} is not divisible by tp={tp}")
    return x.chunk(tp, dim=dim)[rank].clone()


@dataclass(frozen=True)
class Layout:
    """One layout: HF tensors <-> full Megatron tensor, full tensor <-> TP shards."""

    name: str
    to_megatron: Callable[[Sequence[torch.Tensor], Dims], torch.Tensor]
    to_hf: Callable[[torch.Tensor, Dims], list[torch.Tensor]]
    shard: Callable[[torch.Tensor, int, int, Dims], torch.Tensor]
    merge: Callable[[Sequence[torch.Tensor], Dims], torch.Tensor]
    #: the HF shape of each HF tensor, from the full Megatron shape (for receivers that must
    #: allocate before data arrives)
    hf_shapes: Callable[[tuple, Dims], list[tuple]]
    #: dimension the TP shards are cut along (None: replicated)
    split_dim: Optional[int] = 0

    def full_shape(self, shard_shape: Sequence[int], tp: int) -> tuple:
        """The unsharded Megatron shape given one TP shard's shape."""
        s = list(shard_shape)
        if self.split_dim is not None:
            s[self.split_dim] *= tp
        return tuple(s)


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    if layout.name in LAYOUTS:
        raise ValueError(f"layout {layout.name!r} is registered twice")
    LAYOUTS[layout.name] = layout
    return layout


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise KeyError(f"unknown layout {name!r}; registered: {sorted(LAYOUTS)}") from None


def _single(hf: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    _check(len(hf) == 1, f"layout {name} takes one HF tensor, got {len(hf)}")
    return hf[0]


# --- simple layouts ----------------------------------------------------------------------------
register(Layout(
    "replicated",
    to_megatron=lambda hf, d: _single(hf, "replicated"),
    to_hf=lambda m, d: [m],
    shard=lambda m, tp, r, d: m,
    merge=lambda shards, d: shards[0],
    hf_shapes=lambda shape, d: [tuple(shape)],
    split_dim=None,
))
register(Layout(
    "column",
    to_megatron=lambda hf, d: _single(hf, "column"),
    to_hf=lambda m, d: [m],
    shard=lambda m, tp, r, d: _split(m, 0, tp, r, "column"),
    merge=lambda shards, d: torch.cat(list(shards), 0),
    hf_shapes=lambda shape, d: [tuple(shape)],
))
register(Layout(
    "row",
    to_megatron=lambda hf, d: _single(hf, "row"),
    to_hf=lambda m, d: [m],
    shard=lambda m, tp, r, d: _split(m, 1, tp, r, "row"),
    merge=lambda shards, d: torch.cat(list(shards), 1),
    hf_shapes=lambda shape, d: [tuple(shape)],
    split_dim=1,
))


# --- fused qkv -----------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: Dims) -> torch.Tensor:
    """[nq d, *], [nkv d, *], [nkv d, *] -> [(nq + 2 nkv) d, *] grouped [q_g | k_g | v_g]."""
    nq, nkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
    _check(nq % nkv == 0, f"num_heads={nq} is not a multiple of num_kv_heads={nkv}")
    rest = tuple(q.shape[1:])
    for nm, x, rows in (("q", q, nq * hd), ("k", k, nkv * hd), ("v", v, nkv * hd)):
        _check(tuple(x.shape) == (rows,) + rest,
               f"qkv: HF {nm} has shape {tuple(x.shape)}, expected {(rows,) + rest}")
    g = nq // nkv
    qg = q.reshape(nkv, g * hd, *rest)
    kg = k.reshape(nkv, hd, *rest)
    vg = v.reshape(nkv, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((nq + 2 * nkv) * hd, *rest)


def split_qkv(m: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    """Inverse of :func:`fuse_qkv` (also valid on a TP shard with nq/tp, nkv/tp heads in ``d``)."""
    nq, nkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
    rest = tuple(m.shape[1:])
    _check(m.shape[0] == (nq + 2 * nkv) * hd,
           f"qkv: Megatron tensor has {m.shape[0]} rows, expected (nq + 2 nkv) d = {(nq + 2 * nkv) * hd}")
    g = nq // nkv
    x = m.reshape(nkv, (g + 2) * hd, *rest)
    q, k, v = x.split([g * hd, hd, hd], dim=1)
    return [t.reshape(-1, *rest).clone() for t in (q, k, v)]


def _qkv_shard(m, tp, r, d: Dims):
    _check(d.num_kv_heads % tp == 0, f"qkv: num_kv_heads={d.num_kv_heads} is not divisible by tp={tp}")
    return _split(m, 0, tp, r, "qkv")


register(Layout(
    "qkv",
    to_megatron=lambda hf, d: fuse_qkv(*hf, d),
    to_hf=split_qkv,
    shard=_qkv_shard,
    merge=lambda shards, d: torch.cat(list(shards), 0),
    hf_shapes=lambda shape, d: [
        (d.num_heads * d.head_dim, *shape[1:]), (d.num_kv_heads * d.head_dim, *shape[1:]),
        (d.num_kv_heads * d.head_dim, *shape[1:]),
    ],
))


# --- fused gate / up -----------------------------------------------------------------------------
def _gate_up_to_megatron(hf, d: Dims):
    _check(len(hf) == 2, f"gate_up takes gate and up, got {len(hf)} tensors")
    gate, up = hf
    _check(gate.shape == up.shape, f"gate_up: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return torch.cat([gate, up], 0)


def _gate_up_shard(m, tp, r, d):
    gate, up = m.chunk(2, 0)
    return torch.cat([_split(gate, 0, tp, r, "gate"), _split(up, 0, tp, r, "up")], 0)


def _gate_up_merge(shards, d):
    halves = [s.chunk(2, 0) for s in shards]
    return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0)


register(Layout(
    "gate_up",
    to_megatron=_gate_up_to_megatron,
    to_hf=lambda m, d: [t.clone() for t in m.chunk(2, 0)],
    shard=_gate_up_shard,
    merge=_gate_up_merge,
    hf_shapes=lambda shape, d: [(shape[0] // 2, *shape[1:])] * 2,
))


# --- padded vocabulary ---------------------------------------------------------------------------
def pad_vocab(x: torch.Tensor, d: Dims) -> torch.Tensor:
    """[V, *] -> [Vp, *] with zero rows appended."""
    _check(x.shape[0] == d.vocab, f"vocab: HF tensor has {x.shape[0]} rows, config vocab_size is {d.vocab}")
    if d.padded_vocab == d.vocab:
        return x
    _check(d.padded_vocab > d.vocab, f"padded vocab {d.padded_vocab} < vocab {d.vocab}")
    pad = x.new_zeros((d.padded_vocab - d.vocab, *x.shape[1:]))
    return torch.cat([x, pad], 0)


def unpad_vocab(m: torch.Tensor, d: Dims) -> torch.Tensor:
    _check(m.shape[0] == d.padded_vocab, f"vocab: Megatron tensor has {m.shape[0]} rows, expected {d.padded_vocab}")
    return m[: d.vocab].clone()


register(Layout(
    "vocab",
    to_megatron=lambda hf, d: pad_vocab(_single(hf, "vocab"), d),
    to_hf=lambda m, d: [unpad_vocab(m, d)],
    shard=lambda m, tp, r, d: _split(m, 0, tp, r, "vocab"),
    merge=lambda shards, d: torch.cat(list(shards), 0),
    hf_shapes=lambda shape, d: [(d.vocab, *shape[1:])],
))
