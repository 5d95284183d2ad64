"""``sync.check_equal`` against real SGLang: its ``/weights_checker`` hashes, computed here too.

SGLang (0.5.16 .. 0.5.23) answers ``POST /weights_checker {"action": "checksum"}`` with, per engine
TP rank, ``{"checksums": {param_name: "%016x"}, "parallelism_info": {"tp_rank", "tp_size", ...}}``:
a 64-bit content hash of every parameter and buffer it serves (non-persistent rotary caches left
out). :func:`tensor_hash` computes the same number from the same bytes, in integer tensor ops on
any device (the formula of ``sglang.kernels.ops.memory.gpu_tensor_hash``, restated):

* the tensor's bytes, zero-padded to a multiple of 4, are little-endian uint32 words ``v[i]``,
  ``i = 0 .. n-1``; seeds ``s1 = 0x243F6A88``, ``s2 = (s1 * 0x9E3779B1 mod 2^32) ^ 0xDEADBEEF``;
* ``fmix(x)`` = murmur3's 32-bit finaliser with constants ``0x85EBCA6B``, ``0xC2B2AE35``;
  ``rotl(x, r)`` a 32-bit rotation; all arithmetic mod 2^32;
* per word: ``k1 = fmix(v ^ ((i * 0x27D4EB2D + s1) ^ rotl(i, 15)))``,
  ``k2 = fmix(v ^ ((i * 0x165667B1 + s2) ^ rotl(i, 13)))``;
* per tile of 8192 words ``t``: ``h1 = fmix(sum_t k1 ^ 4n)``, ``h2 = fmix(sum_t k2 ^ 4n)`` (sums mod
  2^32, ``4n`` the whole tensor's byte count), and the tile's value ``h1 * 2^32 + h2``;
* the hash is splitmix64's finaliser of the sum of the tiles' values mod 2^64 (0 for no words).

SGLang's parameters are not the Hugging Face tensors one to one (:func:`engine_tensors`): q/k/v
projections are one ``qkv_proj`` (rows q, k, v), gate/up one ``gate_up_proj``, the embedding and
an untied head are zero-padded to a multiple of 64 rows, and with tensor parallelism every rank
holds its shard (column-parallel rows, row-parallel columns, key/value heads replicated when there
are fewer than ranks). Only dense Llama / Qwen2 / Qwen3 layouts are mapped; anything else fails
naming the tensor. Hashes are of the tensor in the engine's dtype (``/server_info`` ``dtype``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
SEED = 0x243F6A88
FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
POS_A, POS_B = 0x27D4EB2D, 0x165667B1
TILE = 8192  # words per tile
SLAB_TILES = 512  # tiles hashed per pass (bounds the int64 temporaries: 4 Mi words)
VOCAB_PAD = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 ``x`` in [0, 2^32), without int64 overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & M32


def _fmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_C2)
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint32 words in int64 [n] (little-endian, zero-padded to 4 bytes)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    return b.view(torch.int32).to(torch.int64) & M32


def tensor_hash(t: torch.Tensor) -> int:
    """SGLang's 64-bit content hash of ``t`` (see the module docstring); computed on ``t``'s device."""
    w = _words(t)
    n = w.numel()
    if n == 0:
        return 0
    s1 = SEED & M32
    s2 = ((SEED * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    nbytes = (4 * n) & M32
    total_hi = total_lo = 0
    slab = TILE * SLAB_TILES
    for start in range(0, n, slab):
        v = w[start:start + slab]
        i = torch.arange(start, start + v.numel(), device=w.device, dtype=torch.int64)
        k1 = _fmix(v ^ (((_mul32(i, POS_A) + s1) & M32) ^ _rotl(i, 15)))
        k2 = _fmix(v ^ (((_mul32(i, POS_B) + s2) & M32) ^ _rotl(i, 13)))
        tiles = -(-v.numel() // TILE)
        pad = tiles * TILE - v.numel()  # words past the end add nothing (masked in the kernel)
        if pad:
            k1, k2 = torch.cat([k1, k1.new_zeros(pad)]), torch.cat([k2, k2.new_zeros(pad)])
        h1 = _fmix((k1.view(tiles, TILE).sum(1) & M32) ^ nbytes)  # tile sums < 2^45: exact in int64
        h2 = _fmix((k2.view(tiles, TILE).sum(1) & M32) ^ nbytes)
        total_hi += int(h1.sum())
        total_lo += int(h2.sum())
    return _splitmix64(((total_hi << 32) + total_lo) & M64)


def hash_hex(t: torch.Tensor) -> str:
    return f"{tensor_hash(t):016x}"


# ------------------------------------------------------------------------- HF -> SGLang tensors
_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
_ROW_PARALLEL = ("o_proj", "down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_REPLICATED = ("norm", "layernorm", "q_norm", "k_norm")


def engine_target(hf_name: str) -> tuple[str, Optional[str]]:
    """(SGLang parameter name, part) of an HF tensor: ``...q_proj.weight`` -> (``...qkv_proj.weight``, "q")."""
    parts = hf_name.split(".")
    for k, p in enumerate(parts):
        if p in _FUSED:
            fused, part = _FUSED[p]
            return ".".join(parts[:k] + [fused] + parts[k + 1:]), part
    return hf_name, None


def padded_vocab(vocab: int, tp: int) -> int:
    """Rows of SGLang's vocab-parallel embedding / head (VocabParallelEmbedding's padding)."""
    pad = VOCAB_PAD
    if math.ceil(vocab / pad) * pad % tp:
        pad *= tp
    return math.ceil(vocab / pad) * pad


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[rank * n:(rank + 1) * n]


def _kv_rows(t: torch.Tensor, rank: int, tp: int, num_kv: int) -> torch.Tensor:
    """Key/value rows of one rank: split over ranks, or one head replicated when num_kv < tp."""
    if num_kv >= tp:
        return _rows(t, rank, tp)
    head = t.shape[0] // num_kv
    shard = rank // (tp // num_kv)
    return t[shard * head:(shard + 1) * head]


def engine_tensors(name: str, parts: dict, rank: int, tp: int, num_kv_heads: int) -> torch.Tensor:
    """The tensor SGLang rank ``rank`` of ``tp`` holds as ``name``, built from the HF tensors of it
    (``parts``: {part: tensor}; {None: tensor} for an unfused one)."""
    base = name.rsplit(".", 2)
    if base[-2:-1] and base[-2] in PARTS:
        kind = base[-2]
        if kind == "qkv_proj":
            pieces = [_rows(parts["q"], rank, tp)] + [_kv_rows(parts[p], rank, tp, num_kv_heads) for p in ("k", "v")]
        else:
            pieces = [_rows(parts[p], rank, tp) for p in PARTS[kind]]
        return torch.cat(pieces, 0)
    t = parts[None]
    if name in _VOCAB:
        rows = padded_vocab(t.shape[0], tp)
        if rows > t.shape[0]:
            t = torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))], 0)
        return _rows(t, rank, tp)
    if any(f".{k}." in f".{name}" for k in _ROW_PARALLEL) and name.endswith(".weight"):
        n = t.shape[1] // tp
        return t[:, rank * n:(rank + 1) * n]
    if tp > 1 and not any(k in name for k in _REPLICATED) and t.dim() > 0:
        raise ValueError(f"sync.check_equal: no SGLang tensor-parallel layout known for {name!r}")
    return t
