"""A compact forward of Llama / Qwen2 / Qwen3 over a static KV cache, on the HF model's own weights.

The embeddings and the rotary embedding are the HF modules, called directly. Each layer's work
around the attention is ours, as two functions of the layer's tensors (``_layer_pieces``): RMSNorm,
ONE projection GEMM for q/k/v (incl. Qwen2's bias), Qwen3's q/k norms and rotary before; the
o-projection, residuals, norm, ONE GEMM for gate/up and the down projection after; a third is the
final norm and LM head. The fused q/k/v and gate/up tensors are the parameters' storage (fuse.py):
no weight is copied per step, so a weight update by HF name (``param.data.copy_``) is seen by the
next step. Shapes (H query heads, Hkv key/value heads, G = H / Hkv, D head dim, C hidden):

    cache per layer          kv [2, B_max, Hkv, L_max, D] (K = kv[0], V = kv[1]); row b holds one sequence
                             at positions 0..len-1
    prefill(ids [U, T] right-padded, lengths [U], slots [U]) -> logits [U, V] of each last prompt token
        causal SDPA over the prompt; K/V written to cache rows ``slots`` at positions 0..T-1
    decode(tok [B], pos [B], Lb) -> logits [B, V]
        K and V of ``tok`` stored at (row b, position pos[b]) by one indexed write per layer; the G
        query heads of a KV head act as G queries of one SDPA call: q [B, Hkv, G, D] against
        K[:B, :, :Lb], additive mask 0 for keys j <= pos[b], -inf elsewhere (made once per step)

Rows never shift: a sequence starts at cache position 0 whatever slot it occupies, so its rotary
positions equal those of an unpadded HF forward.

``attention``: how decode attends ("auto": matmul when G <= MATMUL_MAX_GROUPS, else sdpa).
"sdpa": ``F.scaled_dot_product_attention`` (on the H200 a flash kernel whose 64-row query tile holds
only the G query heads of one KV head: G=2 for Qwen3-1.7B); "matmul": two batched matmuls around a
float32 softmax (HF's eager attention):

    s = q @ K^T [B, Hkv, G, Lb] (model dtype), p = softmax(scale * s + mask) in float32,
    o = p.to(dtype) @ V [B, Hkv, G, D]

each reads the cache once with no padded query rows (tools/bench/profile_fast_decode.py measures both).

``compile``: a torch.compile backend (GPU: "inductor") for the decode step's pieces (the head too)
and the matmul attention; their tensors are read at each call (one compiled graph serves every layer
and batch size; the CUDA graphs capture the compiled kernels); prefill runs pre and post compiled
too (other graphs: T > 1). None: they run eagerly.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

from megaforge.model_families import model_types
from megaforge.rollout.embedded.fast.fuse import fuse_layer


def supported() -> list[str]:
    """The model types the fast path runs: the families megaforge.model_families marks ``fast_decode``."""
    return model_types(fast_decode=True)


ATTENTION = ("auto", "sdpa", "matmul")
#: attention "auto": matmul when a KV head serves at most this many query heads (H200 measurements,
#: docs/benchmarks/README.md: matmul won at Qwen3-1.7B's 2 per KV head, lost at Qwen2-0.5B's 7)
MATMUL_MAX_GROUPS = 2


def unsupported_reason(model) -> Optional[str]:
    """Why :class:`StaticForward` cannot run ``model`` (None: it can)."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in supported():
        return f"model_type {mt!r} (the fast path supports {', '.join(supported())})"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    if not hasattr(model, "lm_head"):
        return "the model has no lm_head"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention layers"
    if getattr(cfg, "use_sliding_window", False):
        return "use_sliding_window"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if "dynamic" in rope or rope == "longrope":
        return f"rope type {rope!r} (its frequencies depend on the sequence length)"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    return None


class StaticKVCache:
    """Per layer one tensor kv [2, B, Hkv, L, D] in the model dtype, preallocated and written in place:
    K = kv[0], V = kv[1] (``k[li]`` / ``v[li]``: views), so one indexed write stores a step's K and V."""

    def __init__(self, n_layers: int, B: int, kv_heads: int, L: int, head_dim: int, dtype, device):
        self.B, self.L = B, L
        self.kv = [torch.zeros((2, B, kv_heads, L, head_dim), dtype=dtype, device=device) for _ in range(n_layers)]
        self.k = [t[0] for t in self.kv]
        self.v = [t[1] for t in self.kv]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """K/V of rows ``src`` [n] (positions < length) into rows ``dst`` [n] (disjoint sets)."""
        for t in self.kv:
            t[:, dst, :, :length] = t[:, src, :, :length]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (normalise in float32, cast back, scale) of x [..., C] with weight w [C]."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """The "matmul" decode attention (module docstring): q [B, Hkv, G, D], k, v [B, Hkv, Lb, D], additive
    mask bias [B, 1, 1, Lb] (float32) -> o [B, Hkv, G, D]; the casts, scale, mask and softmax between
    the two matmuls are one kernel when compiled."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias  # [B, Hkv, G, Lb]
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)


def _layer_pieces(fwd: "StaticForward"):
    """({pre, pre_decode, post, head}, pre_args, post_args): a layer's work around the attention (and the
    final norm + LM head) as functions of tensors
    (the fused projections of fuse.py: one GEMM for q/k/v, one for gate/up).

    pre(x [N, T, C], cos, sin [N, T, D], *pre_args(li)) -> q [N, H, T, D], k, v [N, Hkv, T, D]
        h = rms(x) ln_w;  [q | k | v] = h qkv_w^T + qkv_b;  Qwen3: q, k = rms(q) qn_w, rms(k) kn_w;  rotary
    post(x [N, T, C], o [N, T, H*D], *post_args(li)) -> x [N, T, C]
        x = x + o o_w^T;  h = rms(x) ln_w;  [g | u] = h gate_up_w^T;  x + (act(g) * u) down_w^T
    """
    layers = fwd.model.model.layers
    eps = {float(m.variance_epsilon) for ly in layers for m in (ly.input_layernorm, ly.post_attention_layernorm)}
    eps.add(float(fwd.model.model.norm.variance_epsilon))
    attn0 = layers[0].self_attn
    qk_norm = hasattr(attn0, "q_norm")
    if qk_norm:
        eps |= {float(m.variance_epsilon) for ly in layers for m in (ly.self_attn.q_norm, ly.self_attn.k_norm)}
    if len(eps) != 1:
        raise ValueError(f"fast rollout path: one RMSNorm epsilon needed, the model has {sorted(eps)}")
    splits = {(f["q"], f["kv"], f["ff"]) for f in fwd.fused}
    if len(splits) != 1:
        raise ValueError(f"fast rollout path: the layers' projection sizes differ: {sorted(splits)}")
    eps_v = eps.pop()
    (nq, nkv, nff), = splits
    act, rope, D = layers[0].mlp.act_fn, fwd.apply_rope, fwd.head_dim

    def pre(x, cos, sin, ln_w, qkv_w, qkv_b, qn_w, kn_w):
        N, T = x.shape[0], x.shape[1]
        q, k, v = F.linear(_rms(x, ln_w, eps_v), qkv_w, qkv_b).split([nq, nkv, nkv], dim=-1)
        q, k, v = q.view(N, T, -1, D), k.view(N, T, -1, D), v.view(N, T, -1, D)
        if qk_norm:
            q, k = _rms(q, qn_w, eps_v), _rms(k, kn_w, eps_v)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    def post(x, o, o_w, o_b, ln_w, gu_w, gu_b, d_w, d_b):
        x = x + F.linear(o, o_w, o_b)
        g, u = F.linear(_rms(x, ln_w, eps_v), gu_w, gu_b).split([nff, nff], dim=-1)
        return x + F.linear(act(g) * u, d_w, d_b)

    def pre_args(li):
        a, f = layers[li].self_attn, fwd.fused[li]
        return (layers[li].input_layernorm.weight, f["qkv_w"], f["qkv_b"], a.q_norm.weight if qk_norm else None,
                a.k_norm.weight if qk_norm else None)

    def post_args(li):
        ly, f = layers[li], fwd.fused[li]
        return (ly.self_attn.o_proj.weight, ly.self_attn.o_proj.bias, ly.post_attention_layernorm.weight,
                f["gate_up_w"], f["gate_up_b"], ly.mlp.down_proj.weight, ly.mlp.down_proj.bias)

    def pre_decode(x, cos, sin, *args):
        """pre for one token per row (T = 1) -> q [N, H, 1, D], kv [N, 2, Hkv, D] (K and V stacked for
        the cache's one indexed write)."""
        q, k, v = pre(x, cos, sin, *args)
        return q, torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)

    def head(x, norm_w, lm_w, lm_b):
        """Final norm and LM head of hidden states x [N, C] -> logits [N, V]."""
        return F.linear(_rms(x, norm_w, eps_v), lm_w, lm_b)

    return {"pre": pre, "pre_decode": pre_decode, "post": post, "head": head}, pre_args, post_args


class StaticForward:
    """The model's forward over a :class:`StaticKVCache` (see the module docstring)."""

    def __init__(self, model, compile: Optional[str] = None, attention: str = "auto"):
        why = unsupported_reason(model)
        if why is not None:
            raise ValueError(f"fast rollout path: unsupported model: {why}")
        if attention not in ATTENTION:
            raise ValueError(f"fast rollout path: attention {attention!r}: valid: {', '.join(ATTENTION)}")
        self.model = model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.groups = self.n_heads // self.kv_heads
        if attention == "auto":
            attention = "matmul" if self.groups <= MATMUL_MAX_GROUPS else "sdpa"
        self.attention = attention
        self.n_layers = len(model.model.layers)
        attn0 = model.model.layers[0].self_attn
        self.apply_rope = sys.modules[type(attn0).__module__].apply_rotary_pos_emb
        self.fused = [fuse_layer(ly) for ly in model.model.layers]
        self.eager, self.pre_args, self.post_args = _layer_pieces(self)
        self.compiled = None  # the pieces through torch.compile (same keys as ``eager``)
        self.matmul_attention = matmul_attention
        if compile:
            self.compiled = {k: torch.compile(f, backend=compile, dynamic=True, fullgraph=True)
                             for k, f in self.eager.items()}
            self.matmul_attention = torch.compile(matmul_attention, backend=compile, dynamic=True, fullgraph=True)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes of one token of one row (K and V, every layer)."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def new_cache(self, B: int, L: int, device) -> StaticKVCache:
        return StaticKVCache(self.n_layers, B, self.kv_heads, L, self.head_dim, self.dtype, device)

    def check_fused(self) -> None:
        """Raise unless every layer's q/k/v and gate/up parameters still view the fused tensors (a
        rebinding, e.g. ``load_state_dict(assign=True)``, would leave the fast path on stale weights)."""
        for li, (ly, f) in enumerate(zip(self.model.model.layers, self.fused)):
            a, m = ly.self_attn, ly.mlp
            views = ((a.q_proj.weight, f["qkv_w"], 0), (a.k_proj.weight, f["qkv_w"], f["q"]),
                     (a.v_proj.weight, f["qkv_w"], f["q"] + f["kv"]), (m.gate_proj.weight, f["gate_up_w"], 0),
                     (m.up_proj.weight, f["gate_up_w"], f["ff"]))
            for p, fused, row in views:
                if p.data_ptr() != fused[row].data_ptr():
                    raise RuntimeError(f"fast rollout path: layer {li}: a projection weight no longer views the fused "
                                       "q/k/v or gate/up tensor (the parameter was rebound, not copied into)")

    def _head(self, fn: dict, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of hidden states [N, C] -> logits [N, V] (``fn``: the eager or compiled pieces)."""
        lm = self.model.lm_head
        return fn["head"](x, self.model.model.norm.weight, lm.weight, lm.bias)

    @torch.no_grad()
    def prefill(self, cache: StaticKVCache, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Prompts ids [U, T] (right-padded), lengths [U], cache rows slots [U] -> logits [U, V]."""
        inner = self.model.model
        U, T = ids.shape
        x = inner.embed_tokens(ids)
        pos = torch.arange(T, device=ids.device)[None, :].expand(U, T)
        cos, sin = inner.rotary_emb(x, pos)
        self.check_fused()
        fn = self.compiled or self.eager
        for li, layer in enumerate(inner.layers):
            q, k, v = fn["pre"](x, cos, sin, *self.pre_args(li))
            cache.k[li][slots, :, :T] = k
            cache.v[li][slots, :, :T] = v
            if self.groups > 1:
                k = k.repeat_interleave(self.groups, dim=1)
                v = v.repeat_interleave(self.groups, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.self_attn.scaling)
            x = fn["post"](x, o.transpose(1, 2).reshape(U, T, -1), *self.post_args(li))
        last = x[torch.arange(U, device=ids.device), lengths - 1]
        return self._head(fn, last)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hkv, G, D] against k, v [B, Hkv, Lb, D] with the additive mask bias [B, 1, 1, Lb] (0 where
        a key is seen, -inf elsewhere; :meth:`_mask_bias`) -> o [B, Hkv, G, D]."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return self.matmul_attention(q, k, v, bias, scale)

    def _mask_bias(self, pos: torch.Tensor, Lb: int) -> torch.Tensor:
        """[B, 1, 1, Lb]: 0 for keys j <= pos[b], -inf elsewhere; the model dtype for sdpa (what SDPA makes
        of a boolean mask, at each call), float32 for matmul (added to the float32 scores). Made once
        per step, not per layer."""
        seen = torch.arange(Lb, device=pos.device)[None, :] <= pos[:, None]
        dtype = self.dtype if self.attention == "sdpa" else torch.float32
        zero = torch.zeros((), dtype=dtype, device=pos.device)
        return torch.where(seen, zero, torch.full_like(zero, float("-inf")))[:, None, None, :]

    @torch.no_grad()
    def decode(self, cache: StaticKVCache, tok: torch.Tensor, pos: torch.Tensor, Lb: int) -> torch.Tensor:
        """One token per row: tok [B], pos [B] (its cache position), attention over positions < Lb
        (Lb > max pos of the rows that matter) -> logits [B, V]. No host synchronisation."""
        inner = self.model.model
        B = tok.shape[0]
        Hkv, G, D = self.kv_heads, self.groups, self.head_dim
        x = inner.embed_tokens(tok[:, None])  # [B, 1, C]
        cos, sin = inner.rotary_emb(x, pos[:, None])
        bias = self._mask_bias(pos, Lb)
        rows = torch.arange(B, device=tok.device)
        fn = self.compiled or self.eager
        for li, layer in enumerate(inner.layers):
            q, kv = fn["pre_decode"](x, cos, sin, *self.pre_args(li))
            cache.kv[li][:, rows, :, pos] = kv  # K and V of row b at position pos[b]: one indexed write
            o = self._attend(q.reshape(B, Hkv, G, D), cache.k[li][:B, :, :Lb], cache.v[li][:B, :, :Lb], bias,
                             layer.self_attn.scaling)
            x = fn["post"](x, o.reshape(B, 1, Hkv * G * D), *self.post_args(li))
        return self._head(fn, x[:, 0])
