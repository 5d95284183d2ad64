"""A compact forward of Llama / Qwen2 / Qwen3 over a static KV cache, running the HF model's own modules.

The embeddings, norms (incl. Qwen3's q/k norms), projections (incl. Qwen2's qkv bias), MLPs, rotary
embedding and LM head are the HF modules themselves, called directly: no weight is copied, so a
weight update by HF name (``param.data.copy_``) is seen by the next step. Only the attention and
the cache are ours. Shapes (H query heads, Hkv key/value heads, G = H / Hkv, D head dim, C hidden):

    cache K, V per layer     [B_max, Hkv, L_max, D]   row b holds one sequence at positions 0..len-1
    prefill(ids [U, T] right-padded, lengths [U], slots [U]) -> logits [U, V] of each last prompt token
        causal SDPA over the prompt; K/V written to cache rows ``slots`` at positions 0..T-1
    decode(tok [B], pos [B], Lb) -> logits [B, V]
        K/V of ``tok`` scattered to (row b, position pos[b]); the G query heads of a KV head act as
        G queries of one SDPA call: q [B, Hkv, G, D] against K[:B, :, :Lb], mask key j <= pos[b]

Rows never shift: a sequence starts at cache position 0 whatever slot it occupies, so its rotary
positions equal those of an unpadded HF forward.

``attention``: how decode attends ("auto": matmul when G <= MATMUL_MAX_GROUPS, else sdpa).
"sdpa": ``F.scaled_dot_product_attention`` (on the H200 a flash kernel whose 64-row query tile holds
only the G query heads of one KV head: G=2 for Qwen3-1.7B); "matmul": two batched matmuls around a
float32 softmax (HF's eager attention):

    s = q @ K^T [B, Hkv, G, Lb] (model dtype), p = softmax(scale * s, masked to j <= pos) in float32,
    o = p.to(dtype) @ V [B, Hkv, G, D]

each reads the cache once with no padded query rows (tools/profile_fast_decode.py measures both).

``compile``: a torch.compile backend (GPU: "inductor") for the decode step's per-layer pieces around
the attention (norm, q/k/v, q/k norm, rotary; o-projection, residuals, norm, MLP), written as
functions of the layer's parameter tensors, read at each call (one compiled graph serves every layer
and batch size; the graphs capture the compiled kernels). None: the HF modules themselves.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "qwen3")
ATTENTION = ("auto", "sdpa", "matmul")
#: attention "auto": matmul when a KV head serves at most this many query heads (H200 measurements,
#: docs/benchmarks/README.md: matmul won at Qwen3-1.7B's 2 per KV head, lost at Qwen2-0.5B's 7)
MATMUL_MAX_GROUPS = 2


def unsupported_reason(model) -> Optional[str]:
    """Why :class:`StaticForward` cannot run ``model`` (None: it can)."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED:
        return f"model_type {mt!r} (the fast path supports {', '.join(SUPPORTED)})"
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
    """Per-layer K and V, each [B, Hkv, L, D] in the model dtype, preallocated and written in place."""

    def __init__(self, n_layers: int, B: int, kv_heads: int, L: int, head_dim: int, dtype, device):
        self.B, self.L = B, L
        shape = (B, kv_heads, L, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """K/V of rows ``src`` [n] (positions < length) into rows ``dst`` [n] (disjoint sets)."""
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (normalise in float32, cast back, scale) of x [..., C] with weight w [C]."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def _layer_pieces(fwd: "StaticForward"):
    """(pre, post, pre_args, post_args): the decode step's per-layer work as functions of tensors.

    pre(x [N, T, C], cos, sin [N, T, D], *pre_args(layer)) -> q [N, H, T, D], k, v [N, Hkv, T, D]
    post(x [N, T, C], o [N, T, H*D], *post_args(layer)) -> x [N, T, C]
    """
    layers = fwd.model.model.layers
    eps = {float(m.variance_epsilon) for ly in layers for m in (ly.input_layernorm, ly.post_attention_layernorm)}
    attn0 = layers[0].self_attn
    qk_norm = hasattr(attn0, "q_norm")
    if qk_norm:
        eps |= {float(m.variance_epsilon) for ly in layers for m in (ly.self_attn.q_norm, ly.self_attn.k_norm)}
    if len(eps) != 1:
        raise ValueError(f"fast rollout path: compile needs one RMSNorm epsilon, the model has {sorted(eps)}")
    eps_v = eps.pop()
    act, rope, D = layers[0].mlp.act_fn, fwd.apply_rope, fwd.head_dim

    def pre(x, cos, sin, ln_w, q_w, q_b, k_w, k_b, v_w, v_b, qn_w, kn_w):
        N, T = x.shape[0], x.shape[1]
        h = _rms(x, ln_w, eps_v)
        q = F.linear(h, q_w, q_b).view(N, T, -1, D)
        k = F.linear(h, k_w, k_b).view(N, T, -1, D)
        v = F.linear(h, v_w, v_b).view(N, T, -1, D)
        if qk_norm:
            q, k = _rms(q, qn_w, eps_v), _rms(k, kn_w, eps_v)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    def post(x, o, o_w, o_b, ln_w, g_w, g_b, u_w, u_b, d_w, d_b):
        x = x + F.linear(o, o_w, o_b)
        h = _rms(x, ln_w, eps_v)
        return x + F.linear(act(F.linear(h, g_w, g_b)) * F.linear(h, u_w, u_b), d_w, d_b)

    def pre_args(ly):
        a = ly.self_attn
        return (ly.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
                a.v_proj.weight, a.v_proj.bias, a.q_norm.weight if qk_norm else None,
                a.k_norm.weight if qk_norm else None)

    def post_args(ly):
        a, m = ly.self_attn, ly.mlp
        return (a.o_proj.weight, a.o_proj.bias, ly.post_attention_layernorm.weight, m.gate_proj.weight,
                m.gate_proj.bias, m.up_proj.weight, m.up_proj.bias, m.down_proj.weight, m.down_proj.bias)

    return pre, post, pre_args, post_args


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
        self.compiled = None
        if compile:
            pre, post, pre_args, post_args = _layer_pieces(self)
            self.compiled = (torch.compile(pre, backend=compile, dynamic=True, fullgraph=True),
                             torch.compile(post, backend=compile, dynamic=True, fullgraph=True), pre_args, post_args)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.embed_tokens.weight.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes of one token of one row (K and V, every layer)."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def new_cache(self, B: int, L: int, device) -> StaticKVCache:
        return StaticKVCache(self.n_layers, B, self.kv_heads, L, self.head_dim, self.dtype, device)

    def _qkv(self, attn, h: torch.Tensor):
        """h [N, T, C] -> q [N, H, T, D], k, v [N, Hkv, T, D] (before rotary)."""
        shape = (*h.shape[:-1], -1, self.head_dim)
        q = attn.q_proj(h).view(shape)
        k = attn.k_proj(h).view(shape)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = attn.v_proj(h).view(shape)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of hidden states [N, C] -> logits [N, V]."""
        return self.model.lm_head(self.model.model.norm(x))

    @torch.no_grad()
    def prefill(self, cache: StaticKVCache, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Prompts ids [U, T] (right-padded), lengths [U], cache rows slots [U] -> logits [U, V]."""
        inner = self.model.model
        U, T = ids.shape
        x = inner.embed_tokens(ids)
        pos = torch.arange(T, device=ids.device)[None, :].expand(U, T)
        cos, sin = inner.rotary_emb(x, pos)
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x))
            q, k = self.apply_rope(q, k, cos, sin)
            cache.k[li][slots, :, :T] = k
            cache.v[li][slots, :, :T] = v
            if self.groups > 1:
                k = k.repeat_interleave(self.groups, dim=1)
                v = v.repeat_interleave(self.groups, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(U, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(U, device=ids.device), lengths - 1]
        return self._head(last)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hkv, G, D] against k, v [B, Hkv, Lb, D] where mask [B, 1, 1, Lb] -> o [B, Hkv, G, D]."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        s = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, Lb]
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.matmul(p.to(v.dtype), v)

    @torch.no_grad()
    def decode(self, cache: StaticKVCache, tok: torch.Tensor, pos: torch.Tensor, Lb: int) -> torch.Tensor:
        """One token per row: tok [B], pos [B] (its cache position), attention over positions < Lb
        (Lb > max pos of the rows that matter) -> logits [B, V]. No host synchronisation."""
        inner = self.model.model
        B = tok.shape[0]
        Hkv, G, D = self.kv_heads, self.groups, self.head_dim
        x = inner.embed_tokens(tok[:, None])  # [B, 1, C]
        cos, sin = inner.rotary_emb(x, pos[:, None])
        mask = (torch.arange(Lb, device=tok.device)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, Lb]
        idx = pos.view(B, 1, 1, 1).expand(B, Hkv, 1, D)
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            if self.compiled is not None:
                q, k, v = self.compiled[0](x, cos, sin, *self.compiled[2](layer))
            else:
                q, k, v = self._qkv(attn, layer.input_layernorm(x))
                q, k = self.apply_rope(q, k, cos, sin)
            kc, vc = cache.k[li][:B], cache.v[li][:B]
            kc.scatter_(2, idx, k)
            vc.scatter_(2, idx, v)
            o = self._attend(q.reshape(B, Hkv, G, D), kc[:, :, :Lb], vc[:, :, :Lb], mask, attn.scaling)
            o = o.reshape(B, 1, Hkv * G * D)
            if self.compiled is not None:
                x = self.compiled[1](x, o, *self.compiled[3](layer))
                continue
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._head(x[:, 0])
