"""megaforge's own layers for the ``torch`` layer spec: an RMSNorm that supports sequence
parallelism, core attention over ``torch.nn.functional.scaled_dot_product_attention`` with
packed sequences (``thd``, and :data:`DOCUMENTS_FORMAT` without context parallelism) and context
parallelism, and :class:`DocumentRotary` (the packed rows' RoPE table made once per forward).

Shapes (megatron conventions): ``s`` sequence, ``b`` batch, ``t`` packed tokens, ``np``/``ng``
query heads / key-value groups on this TP rank, ``hn`` head dim.

Context parallelism (CP = c ranks) uses the load-balanced causal layout megatron and Transformer
Engine use: every (padded) sequence of length P is cut into 2c chunks of P/(2c) tokens and CP rank r
holds chunks r and 2c-1-r, in that order. Attention all-gathers K and V over the CP group (backward:
reduce-scatter, so every rank's K/V receive the gradient from every rank's queries) and masks by the
tokens' global positions: query at position i of sequence d attends to key j of the same sequence iff
j <= i.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


class RMSNorm(torch.nn.Module):
    """y = w * (x / sqrt(mean(x^2, -1) + eps)), computed in float32 and cast back before the
    weight is applied (the order of Hugging Face's LlamaRMSNorm, so bf16 results match).

    Under sequence parallelism each TP rank normalises a different slice of the sequence, so the
    weight's gradient differs per rank: the weight is marked ``sequence_parallel`` and megatron's
    ``finalize_model_grads`` all-reduces it over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"megaforge RMSNorm used with normalization={config.normalization!r}")
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("megaforge RMSNorm does not support zero-centered gamma")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _group_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def cp_chunk_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions [seq_len / cp_size] held by ``cp_rank`` for a sequence of ``seq_len``
    tokens (chunks r and 2c-1-r of 2c equal chunks)."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*context_parallel={2 * cp_size}")
    c = seq_len // (2 * cp_size)
    a = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    j = 2 * cp_size - 1 - cp_rank
    return torch.cat([a, torch.arange(j * c, (j + 1) * c, device=device)])


#: ``PackedSeqParams.qkv_format`` of packed micro-batches on the torch spec without context parallelism:
#: megatron's attention treats it as [t, 1, ...] rows (it only special-cases "thd"), so RoPE runs once over
#: the packed rows with the per-token table :class:`DocumentRotary` made for the micro-batch, and
#: :class:`SDPAttention` attends within the documents of ``cu_seqlens_padded_list``. With "thd" megatron's
#: unfused RoPE splits q and k by document and concatenates the frequencies in every layer (host work that
#: made the 0.5B step 0.82-0.90 of raw megatron-core's on an H100, docs/benchmarks/README.md).
DOCUMENTS_FORMAT = "sbhd_documents"


class DocumentRotary(torch.nn.Module):
    """megatron's :class:`RotaryEmbedding` (``inner``, called as it is for every other input) that, for
    a micro-batch in :data:`DOCUMENTS_FORMAT`, returns its table at each packed token's position within
    its document: ``inner(L)[positions]`` [t, 1, 1, d], with L the params' ``max_seqlen_q`` and
    ``positions`` = ``packed_seq_params.rope_positions`` [t] (0 .. len_d - 1 for each document d).

    GPTModel asks for the rotary length (``get_rotary_seq_len(..., packed_seq_params)``) and then for
    the table (``forward(length, ...)``), once per forward, and hands the table to every layer: the
    first call notes the positions of the params it is given (None for any other input), the second
    uses them. No parameters or buffers (the state dict is unchanged)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self._positions = None

    def get_rotary_seq_len(self, inference_context, transformer, transformer_input, transformer_config,
                           packed_seq_params=None, **kw):
        docs = packed_seq_params is not None and packed_seq_params.qkv_format == DOCUMENTS_FORMAT
        self._positions = packed_seq_params.rope_positions if docs else None
        return self.inner.get_rotary_seq_len(inference_context, transformer, transformer_input, transformer_config,
                                             packed_seq_params, **kw)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        positions, self._positions = self._positions, None
        table = self.inner(max_seq_len, offset, packed_seq=packed_seq, cp_group=cp_group)
        if positions is None:
            return table
        return table.index_select(0, positions)  # [t, 1, 1, d]


def use_document_rotary(model) -> None:
    """Give ``model`` (a GPTModel of the torch spec) a :class:`DocumentRotary` around its RoPE table
    (exactly megatron's ``RotaryEmbedding``; YaRN and multimodal RoPE are left as they are: packing
    then keeps "thd")."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if type(getattr(model, "rotary_pos_emb", None)) is RotaryEmbedding:
        model.rotary_pos_emb = DocumentRotary(model.rotary_pos_emb)


def has_document_rotary(model) -> bool:
    """Whether ``model`` (a GPTModel, or a wrapper of one under ``.module``: DDP) has :class:`DocumentRotary`."""
    while not hasattr(model, "rotary_pos_emb") and hasattr(model, "module"):
        model = model.module
    return isinstance(getattr(model, "rotary_pos_emb", None), DocumentRotary)


@functools.lru_cache(maxsize=8)
def padded_index(docs: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, int, int]:
    """(row of the padded [n * L] layout of each packed position [t], n, L) for n contiguous documents
    (start, end) covering 0..t, L the longest: document d's j-th token goes to d * L + j. Cached: every
    layer of a micro-batch (and its backward) attends over the same documents."""
    lens = torch.tensor([hi - lo for lo, hi in docs])
    width = int(lens.max())
    row = torch.repeat_interleave(torch.arange(len(docs)), lens)
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    flat = row * width + pos  # pinned and non-blocking to CUDA: a pageable copy synchronizes the stream
    return (flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat), len(docs), width


@functools.lru_cache(maxsize=8)
def device_offsets(cu: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Document offsets ``cu`` [n + 1] as int32 on ``device``, through pinned memory without blocking (a
    copy from pageable memory would synchronize the stream). Cached: every layer of a micro-batch and
    its backward attend over the same documents."""
    t = torch.tensor(cu, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@functools.lru_cache(maxsize=1)
def varlen_kernel():
    """aten's flash attention over packed documents, ``torch.ops.aten._flash_attention_forward`` with cu_seqlens
    (the kernel PyTorch's ``torch.nn.attention.varlen.varlen_attn`` calls), or None where this torch lacks it or
    its autograd. Called directly, its backward is aten's C++ ``FlashAttentionBackward0``; ``varlen_attn`` wraps
    the same kernel in a Python custom op (Python dispatch forward and backward, and an rng-state tensor made
    on the device every call): host time in every layer of a step that is host-bound at 0.5B (the H100's
    figures in docs/benchmarks/README.md)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not hasattr(torch._C._functions, "FlashAttentionBackward0"):
        return None
    return op


class SDPAttention(MegatronModule):
    """Core attention: softmax(q k^T * scale + causal/document mask) v via PyTorch SDPA.

    Input (``sbhd``): q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np*hn].
    Input (``thd``, packed): q [t, np, hn], k/v [t, ng, hn] -> [t, np*hn], with document
    boundaries from ``packed_seq_params.cu_seqlens_q_padded`` (global, pre-CP coordinates; padding
    inside a document sits after its real tokens, so causality keeps it out of real tokens' view).
    Every call is 4-D with a causal flag or a boolean mask, so PyTorch can pick a fused kernel.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        tp = _group_size(tp_group) if tp_group is not None else parallel_state.get_tensor_model_parallel_world_size()
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            self.cp_group = parallel_state.get_context_parallel_group()
        self.np = config.num_attention_heads // tp
        self.hn = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hn)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    # -- helpers ------------------------------------------------------------------------------
    def _sdpa(self, q, k, v, causal: bool, mask=None):
        """q [b, np, Lq, hn], k/v [b, ng, Lk, hn] (4-D: PyTorch's fused kernels need it).

        Without a mask, grouped K/V go in as they are (``enable_gqa``: flash attention on GPU);
        with a mask (context parallelism) they are expanded to the query heads first, since the
        memory-efficient kernel that takes masks does not do GQA."""
        p = self.dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        if gqa and mask is not None:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal and mask is None, scale=self.scale,
            enable_gqa=gqa,
        )

    def _cp_gather(self, x):
        """[t_local, ...] -> [cp * t_local, ...] rank-major; backward reduce-scatters."""
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=self.cp_group)

    def _attend(self, q, k, v, docs: list[tuple[int, int]]) -> torch.Tensor:
        """Causal attention within each document; q [t, b, np, hn], k/v [t, b, ng, hn] ->
        [t, b, np, hn]. ``docs`` are (start, end) in global (pre-CP) positions; under CP this
        rank holds rows start/c .. end/c of each, in the load-balanced layout."""
        cp = _group_size(self.cp_group)
        to4 = lambda x: x.permute(1, 2, 0, 3)  # noqa: E731  [L, b, h, d] -> [b, h, L, d]
        if cp == 1 and len(docs) > 1 and q.shape[1] == 1 and docs[0][0] == 0 and docs[-1][1] == q.shape[0]:
            if self._varlen_ok(q):
                return self._attend_varlen(q, k, v, docs)
            return self._attend_padded(q, k, v, docs)
        if cp > 1:
            r = torch.distributed.get_rank(self.cp_group)
            t_local = q.shape[0]
            k_all, v_all = self._cp_gather(k), self._cp_gather(v)  # [cp * t_local, b, ng, hn]
        outs = []
        for lo, hi in docs:
            n, llo = hi - lo, lo // cp
            qi = to4(q[llo:llo + n // cp])
            if cp == 1:
                o = self._sdpa(qi, to4(k[lo:hi]), to4(v[lo:hi]), causal=True)
            else:
                # the document's rows of the rank-major gather, put back in global order
                rows = torch.cat([torch.arange(rr * t_local + llo, rr * t_local + llo + n // cp) for rr in range(cp)])
                pos = torch.cat([cp_chunk_positions(n, cp, rr) for rr in range(cp)])
                idx = rows[torch.argsort(pos)].to(q.device)
                qpos = cp_chunk_positions(n, cp, r, device=q.device)
                mask = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # [n / cp, n]
                o = self._sdpa(qi, to4(k_all[idx]), to4(v_all[idx]), causal=False, mask=mask)
            outs.append(o.permute(2, 0, 1, 3))
        return torch.cat(outs, 0)

    def _varlen_ok(self, q) -> bool:
        """Whether :meth:`_attend_varlen` serves ``q``: aten's varlen flash attention exists and runs on CUDA
        in bfloat16 / float16 without dropout."""
        if varlen_kernel() is None or q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
            return False
        return not (self.training and self.dropout > 0)

    def _attend_varlen(self, q, k, v, docs: list[tuple[int, int]]) -> torch.Tensor:
        """Causal attention within each document as one varlen flash-attention call over the packed rows:
        q [t, 1, np, hn], k/v [t, 1, ng, hn] -> [t, 1, np, hn], documents given by their offsets
        cu [n + 1]. Unlike :meth:`_attend_padded` nothing is scattered or gathered and no padded
        position is computed: per layer 1 kernel forward and 1 backward instead of 4 index copies each
        way around an SDPA call (the 0.5B step's host time, docs/benchmarks/README.md)."""
        t, np_, hn = q.shape[0], q.shape[2], q.shape[3]
        cu = device_offsets(tuple(lo for lo, _ in docs) + (docs[-1][1],), q.device)
        longest = max(hi - lo for lo, hi in docs)
        # q [t, np, hn], k/v [t, ng, hn] (flash attention takes ng | np K/V heads as they are), no dropout, causal
        out = varlen_kernel()(q[:, 0], k[:, 0], v[:, 0], cu, cu, longest, longest, 0.0, True, False, scale=self.scale)[0]
        return out.view(t, 1, np_, hn)

    def _attend_padded(self, q, k, v, docs: list[tuple[int, int]]) -> torch.Tensor:
        """Causal attention within each of n documents as ONE SDPA call: the packed rows q [t, 1, np, hn],
        k/v [t, 1, ng, hn] are scattered into a zero-padded [n, h, L, hn] batch (L the longest
        document; padding after each document's tokens, so causality keeps it out of every real
        query's view), attended with ``is_causal``, and the real rows gathered back: [t, 1, np, hn].
        The per-document loop made n SDPA calls (and their slicing) per layer, forward and backward:
        at 16 rows a micro-batch and 24 layers, 768 small kernels and host round trips; this makes 1
        call and 4 index copies a layer, for at most n L - t padded positions of attention work."""
        t, np_, hn = q.shape[0], q.shape[2], q.shape[3]
        flat, n, width = padded_index(tuple(docs), q.device)

        def pad(x):  # [t, 1, h, hn] -> [n, h, L, hn]
            buf = x.new_zeros(n * width, x.shape[2], hn).index_copy(0, flat, x[:, 0])
            return buf.view(n, width, x.shape[2], hn).transpose(1, 2)

        o = self._sdpa(pad(q), pad(k), pad(v), causal=True)  # [n, np, L, hn]
        return o.transpose(1, 2).reshape(n * width, np_, hn).index_select(0, flat).view(t, 1, np_, hn)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention_bias")
        fmt = packed_seq_params.qkv_format if packed_seq_params is not None else None
        if fmt in ("thd", DOCUMENTS_FORMAT):
            cu = getattr(packed_seq_params, "cu_seqlens_padded_list", None)  # set by megaforge's packing
            if cu is None:
                t = packed_seq_params.cu_seqlens_q_padded
                cu = (t if t is not None else packed_seq_params.cu_seqlens_q).tolist()
            cu = [int(x) for x in cu]
            # thd: q [t, np, hn] -> [t, np*hn]; DOCUMENTS_FORMAT (RoPE applied per document by DocumentRotary,
            # no CP): megatron's plain rows q [t, 1, np, hn] -> [t, 1, np*hn]
            rows = fmt == DOCUMENTS_FORMAT
            q, k, v = (query, key, value) if rows else (query[:, None], key[:, None], value[:, None])
            out = self._attend(q, k, v, list(zip(cu[:-1], cu[1:])))
            return out.reshape(out.shape[0], 1, -1) if rows else out.reshape(out.shape[0], -1)
        s_local, b = query.shape[:2]
        if attention_mask is not None:  # explicit mask (True = masked out), one CP rank only
            if self.cp_group is not None and _group_size(self.cp_group) > 1:
                raise ValueError("context parallelism with an explicit attention_mask is not supported")
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = self._sdpa(q, k, v, causal=False, mask=~attention_mask).permute(2, 0, 1, 3)
        else:  # every batch row is one causal sequence of cp * s_local tokens
            out = self._attend(query, key, value, [(0, _group_size(self.cp_group) * s_local)])
        return out.reshape(s_local, b, -1)
