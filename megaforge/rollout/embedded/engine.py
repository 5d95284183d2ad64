"""The embedded engine: a Hugging Face CausalLM with megaforge's own batched sampling loop.

It is the CPU / development default and the reference the other engines are tested against. Per
decoding step (KV cache through transformers' DynamicCache, prompts left-padded):

    logits [B, V] -> sampling.sample_tokens -> token [B], logprob [B]

A row finishes on a stop token (kept in the output, like SGLang with ``no_stop_trim``), a stop
string, ``max_new_tokens`` or an abort. Memory release/resume is tracked: generating while the
weights are released is an error.

``fast`` (``rollout.fast``): ``auto`` serves generate with :mod:`megaforge.rollout.embedded.fast` (static KV
cache, continuous refill, CUDA graphs) on CUDA devices for supported models (Llama, Qwen2, Qwen3),
``on`` forces it (also on CPU, without graphs: the tests' mode), ``off`` keeps this simple loop.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterable, Optional, Sequence

import torch

from megaforge.hf import DTYPES, load_hf_model, resolve_device
from megaforge.memory.offload import Entry, PinnedOffloader
from megaforge.rollout.base import MEMORY_TAGS, Engine, EngineStateError, check_tags
from megaforge.rollout.embedded.fast import FastDecoder, unsupported_reason
from megaforge.rollout.embedded.sampling import sample_tokens
from megaforge.specs import EngineSpec, expect
from megaforge.sync.adapters import adapter_pairs, merge_lora
from megaforge.types import Completion, GenerateRequest


log = logging.getLogger(__name__)


def fast_options(compile: str, attention: str, device: torch.device) -> dict:
    """FastDecoder options of ``rollout.fast_compile`` / ``rollout.fast_attention`` on ``device``
    (compile auto: inductor on CUDA, none elsewhere)."""
    backend = {"auto": "inductor" if device.type == "cuda" else None, "inductor": "inductor", "off": None}[compile]
    return {"compile": backend, "attention": attention}


def expert_views(model) -> dict:
    """Checkpoint names of per-expert tensors -> views into transformers 5's fused expert parameters
    (Qwen3-MoE and kin: ``experts.gate_up_proj`` [E, 2 I, H], ``experts.down_proj`` [E, H, I]), so a weight
    update by the HF checkpoint's names (``...mlp.experts.{e}.{gate,up,down}_proj.weight``, as the trainer
    and SGLang's loader name them) is copied into the fused storage. Empty for other models."""
    out = {}
    for li, ly in enumerate(getattr(getattr(model, "model", None), "layers", None) or []):
        ex = getattr(getattr(ly, "mlp", None), "experts", None)
        gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
        if not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3:
            continue
        i = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            pre = f"model.layers.{li}.mlp.experts.{e}."
            out[pre + "gate_proj.weight"] = gu[e, :i]
            out[pre + "up_proj.weight"] = gu[e, i:]
            out[pre + "down_proj.weight"] = dn[e]
    return out


class RoutingRecorder:
    """The experts an HF MoE model routes each token to during the simple decode loop, per row, in
    SGLang's format (:mod:`megaforge.rollout.routing`): [n, num_layers, K] int32, dense layers 0.

    Inside ``with recorder:`` forward hooks on the routers (:meth:`EmbeddedEngine.routing_layers`) keep
    each call's top-k ids [B * T, K]; :meth:`take` files the forward's [B, T, layers, K] under each row
    from its column ``first[b]`` on (None: the row was fed padding, nothing filed)."""

    def __init__(self, gates: list):
        self.gates = gates
        self.k = next(int(g.top_k) for g in gates if g is not None)
        self._calls: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self.rows: dict[int, list[torch.Tensor]] = {}

    def __enter__(self):
        def hook(li):
            def fn(_module, _inp, out):
                ids = out[-1] if isinstance(out, tuple) else None
                if ids is None or ids.dtype.is_floating_point or ids.dim() != 2 or ids.shape[1] != self.k:
                    raise RuntimeError(f"return_routed_experts: layer {li}'s router returned no top-k expert ids "
                                       f"[tokens, {self.k}] (an unsupported MoE implementation)")
                self._calls[li] = ids.detach().to("cpu", torch.int32)
            return fn

        self._calls = {}
        self._hooks = [g.register_forward_hook(hook(li)) for li, g in enumerate(self.gates) if g is not None]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return False

    def take(self, step: int, shape, first: list) -> None:
        B, T = shape
        table = torch.zeros((B, T, len(self.gates), self.k), dtype=torch.int32)
        for li, ids in self._calls.items():
            table[:, :, li] = ids.view(B, T, self.k)
        for b, f in enumerate(first):
            if f is not None:
                self.rows.setdefault(b, []).append(table[b, f:])

    def table(self, b: int, n: int) -> torch.Tensor:
        """Row ``b``'s routing of its first ``n`` tokens (prompt + output - 1) [n, layers, K]."""
        return torch.cat(self.rows.get(b, []) or [torch.zeros((0, len(self.gates), self.k), dtype=torch.int32)])[:max(n, 0)]


class EmbeddedEngine(Engine):
    def __init__(self, model, tokenizer=None, max_batch: int = 256, pad_token_id: Optional[int] = None,
                 fast: str = "auto", fast_options: Optional[dict] = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.device = next(model.parameters()).device
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = self._valid_pad(pad_token_id)
        self.progress_time = 0.0  # time.monotonic() of the last decoding step (the server's /health_generate)
        self._version = 0
        self._released: set[str] = set()
        self._abort = threading.Event()
        self._lock = threading.Lock()
        self._params = dict(model.state_dict(keep_vars=True))
        self._params.update(expert_views(model))  # MoE: the checkpoint's per-expert names (what the trainer sends)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(0)
        self._fast = self._select_fast(fast, fast_options or {})

    def _valid_pad(self, pad: Optional[int]) -> int:
        """The id that fills left padding: the tokenizer's pad id when the model can embed it, else the
        model config's, else 0. Padded positions are masked out, so any id of the embedding does; a
        tokenizer without a pad token (megaforge.hf.load_tokenizer then pads with eos) may name one
        outside the model's vocabulary, which would fail in the embedding of a ragged batch."""
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
        for cand in (pad, getattr(self.model.config, "pad_token_id", None), 0):
            if isinstance(cand, int) and 0 <= cand < (vocab or cand + 1):
                return cand
        return 0

    def mark_progress(self) -> None:
        """Record a decoding step (read as ``progress_time``)."""
        self.progress_time = time.monotonic()

    def _select_fast(self, fast: str, options: dict):
        """The FastDecoder serving generate, or None (the simple loop); see the module docstring."""
        if fast not in ("auto", "on", "off"):
            raise ValueError(f"rollout.fast {fast!r}: valid: auto, on, off")
        if fast == "off" or (fast == "auto" and self.device.type != "cuda"):
            return None
        why = unsupported_reason(self.model)
        if why is not None:
            if fast == "on":
                raise ValueError(f"rollout.fast=on: {why}")
            log.info("embedded engine: simple decode loop (fast path unavailable: %s)", why)
            return None
        return FastDecoder(self, **options)

    @property
    def fast(self):
        """The :class:`~megaforge.rollout.embedded.fast.FastDecoder` serving generate (None: the simple loop)."""
        return self._fast

    # ------------------------------------------------------------------------------- construction
    @classmethod
    def from_spec(cls, spec: EngineSpec, tokenizer=None, device: Optional[str] = None) -> "EmbeddedEngine":
        """The engine of an :class:`~megaforge.specs.EngineSpec` (``rollout.engine: embedded``'s build):
        ``model`` loaded on ``rollout.device`` (or ``device``) in the engines' dtype,
        ``rollout.engine_batch_size``, ``rollout.fast`` / ``fast_compile`` / ``fast_attention``."""
        r = expect(spec, EngineSpec, "EmbeddedEngine.from_spec").rollout
        dev = resolve_device(device or r.device)
        model = load_hf_model(spec.model, dev, dtype=DTYPES[spec.dtype])
        return cls(model, tokenizer, max_batch=r.engine_batch_size, fast=r.fast,
                   fast_options=fast_options(r.fast_compile, r.fast_attention, dev))

    # ----------------------------------------------------------------------------------- generate
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        if "weights" in self._released or "kv_cache" in self._released:
            raise EngineStateError(f"generate called while memory is released ({sorted(self._released)})")
        for i, r in enumerate(requests):
            if not r.input_ids:
                raise ValueError(f"request {i} ({r.rid!r}): empty input_ids")
        self._abort.clear()
        if any(r.return_routed_experts for r in requests):
            if self.routing_layers() is None:
                raise ValueError("return_routed_experts: the engine's model has no mixture-of-experts layers")
            if self._fast is not None:
                raise ValueError("return_routed_experts: the fast decode path has no MoE forward (rollout.fast off)")
        if self._fast is not None:
            with self._lock:
                return self._fast.generate(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].input_ids))
        out: list[Optional[Completion]] = [None] * len(requests)
        with self._lock:
            for s in range(0, len(order), self.max_batch):
                idx = order[s: s + self.max_batch]
                for i, c in zip(idx, self._generate_batch([requests[i] for i in idx])):
                    out[i] = c
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], temperature: float = 1.0) -> list[list[Optional[float]]]:
        """Per prompt x (len L), ``[None, lp_1, ..., lp_{L-1}]`` with lp_t = log_softmax(logits_{t-1} / temperature)
        [x_t] in float32 (as SGLang's ``meta_info.input_token_logprobs`` values with ``logprob_start_len`` 0:
        nothing for the first token). ``max_batch`` prompts per forward, right-padded (the padding is
        masked and after every real token, so it changes no real position)."""
        if "weights" in self._released:
            raise EngineStateError("prompt_logprobs called while the weights are released")
        out: list[list[Optional[float]]] = []
        with self._lock:
            for s in range(0, len(prompts), self.max_batch):
                chunk = [list(p) for p in prompts[s: s + self.max_batch]]
                L = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), L), self.pad_id, dtype=torch.long)
                attn = torch.zeros((len(chunk), L), dtype=torch.long)
                for b, p in enumerate(chunk):
                    ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
                    attn[b, :len(p)] = 1
                ids, attn = ids.to(self.device), attn.to(self.device)
                logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
                lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0].cpu()
                out += [[None] + lp[b, :len(p) - 1].tolist() for b, p in enumerate(chunk)]
        return out

    @torch.no_grad()
    def _generate_batch(self, reqs: list[GenerateRequest]) -> list[Completion]:
        dev = self.device
        B = len(reqs)
        L = max(len(r.input_ids) for r in reqs)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for b, r in enumerate(reqs):
            n = len(r.input_ids)
            ids[b, L - n:] = torch.tensor(r.input_ids, dtype=torch.long)
            attn[b, L - n:] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        temp = torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32, device=dev)
        top_k = torch.tensor([r.sampling.top_k for r in reqs], dtype=torch.long, device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32, device=dev)
        max_new = [r.sampling.max_new_tokens for r in reqs]
        stop_ids = [set(r.sampling.stop_token_ids) for r in reqs]
        stop_strs = [list(r.sampling.stop) for r in reqs]
        if any(stop_strs) and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        seeds = torch.tensor([-1 if r.sampling.seed is None else int(r.sampling.seed) for r in reqs],
                             dtype=torch.long, device=dev)
        gen = self._generator

        outputs: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        reason: list[Optional[str]] = [None] * B
        position = (attn.cumsum(-1) - 1).clamp_min(0)
        past = None
        cur_ids, cur_pos = ids, position
        rec = RoutingRecorder(self.routing_layers()) if any(r.return_routed_experts for r in reqs) else None
        fed = [True] * B  # whether the token each row is fed this step is its own (not padding after its end)
        for step in range(max(max_new)):
            with rec or contextlib.nullcontext():
                out = self.model(input_ids=cur_ids, attention_mask=attn, position_ids=cur_pos,
                                 past_key_values=past, use_cache=True)
            if rec is not None:
                rec.take(step, cur_ids.shape, [(L - len(r.input_ids)) if step == 0 else (0 if fed[b] else None)
                                                for b, r in enumerate(reqs)])
            self.mark_progress()
            past = out.past_key_values
            tok, lp = sample_tokens(out.logits[:, -1, :], temp, top_k, top_p, gen, seeds,
                                    torch.full((B,), step, dtype=torch.long, device=dev))
            tok_l, lp_l = tok.tolist(), lp.tolist()
            aborted = self._abort.is_set()
            for b in range(B):
                if reason[b] is not None:
                    continue
                if aborted:
                    reason[b] = "abort"
                    continue
                outputs[b].append(tok_l[b])
                logps[b].append(lp_l[b])
                if tok_l[b] in stop_ids[b]:
                    reason[b] = "stop"
                elif stop_strs[b] and self.hit_stop_string(outputs[b], stop_strs[b]):
                    reason[b] = "stop"
                elif len(outputs[b]) >= max_new[b]:
                    reason[b] = "length"
            if all(r is not None for r in reason):
                break
            # finished rows keep decoding padding; their outputs are no longer extended
            fed = [reason[b] is None for b in range(B)]
            nxt = torch.tensor([tok_l[b] if reason[b] is None else self.pad_id for b in range(B)], device=dev)
            cur_ids = nxt[:, None]
            cur_pos = cur_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
        comps = []
        for b, r in enumerate(reqs):
            text = self.tokenizer.decode(outputs[b], skip_special_tokens=False) if self.tokenizer is not None else ""
            routed = rec.table(b, len(r.input_ids) + len(outputs[b]) - 1) if rec is not None and r.return_routed_experts else None
            comps.append(Completion(r.rid, outputs[b], logps[b], reason[b] or "length", self._version, text,
                                    routed_experts=routed))
        return comps

    def routing_layers(self) -> Optional[list]:
        """Per decoder layer its MoE router module (None for a dense layer); None for a dense model.
        A router is the HF MoE block's ``gate`` (transformers 5: Qwen3MoeTopKRouter and kin), whose
        forward returns (router logits, top-k weights, top-k expert ids [N, K])."""
        layers = getattr(getattr(self.model, "model", None), "layers", None) or []
        gates = [getattr(ly.mlp, "gate", None) if hasattr(getattr(ly, "mlp", None), "experts") else None for ly in layers]
        return gates if any(g is not None for g in gates) else None

    def hit_stop_string(self, out_ids: list[int], stops: list[str]) -> bool:
        """Whether one of ``stops`` occurs in the text of the last 16 tokens of ``out_ids``."""
        tail = self.tokenizer.decode(out_ids[-16:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    # ------------------------------------------------------------------------------------ weights
    def update_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> None:
        if "weights" in self._released:
            raise EngineStateError("update_weights called while the weights are released; resume 'weights' first")
        with self._lock, torch.no_grad():
            self._params.update(expert_views(self.model))  # fresh views (a weight release may move the storage)
            for bucket in buckets:
                self.load_tensors(bucket)
            self._version = int(version)

    def update_adapters(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int, scale: float) -> None:
        """LoRA adapters alone (``sync.lora_adapters``, :mod:`megaforge.sync.adapters`): each adapted
        ``M.weight`` becomes merge_lora(W0, A, B, scale), W0 the base weight this engine held before its
        first adapter update (kept as a copy)."""
        if "weights" in self._released:
            raise EngineStateError("update_adapters called while the weights are released; resume 'weights' first")
        if not hasattr(self, "_lora_base"):
            self._lora_base: dict[str, torch.Tensor] = {}
        with self._lock, torch.no_grad():
            for mod, a, b in adapter_pairs(buckets):
                name = mod + ".weight"
                p = self._params.get(name)
                if p is None:
                    raise KeyError(f"update_adapters: the engine's model has no tensor {name!r}")
                if (b.shape[0], a.shape[1]) != tuple(p.shape) or a.shape[0] != b.shape[1]:
                    raise ValueError(f"update_adapters: {mod}: A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                                     f"fit the weight {tuple(p.shape)}")
                base = self._lora_base.setdefault(name, p.detach().clone())
                p.data.copy_(merge_lora(base, a.to(p.device), b.to(p.device), scale))
            self._version = int(version)

    def check_specs(self, specs: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Raise (naming the tensor) unless every ``(name, shape, dtype)`` can be loaded: a tensor of the
        model, its shape, a floating dtype for a floating tensor (else the same dtype), each name once."""
        seen = set()
        for name, shape, dtype in specs:
            p = self._params.get(name)
            if p is None:
                raise KeyError(f"update_weights: the engine's model has no tensor {name!r}")
            if tuple(p.shape) != tuple(shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(shape)}, the engine's is {tuple(p.shape)}")
            if (dtype.is_floating_point != p.is_floating_point()) or (not p.is_floating_point() and dtype != p.dtype):
                raise ValueError(f"update_weights: {name!r} has dtype {dtype}, the engine's is {p.dtype}")
            if name in seen:
                raise ValueError(f"update_weights: {name!r} appears twice in one update")
            seen.add(name)

    def load_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``named`` into the model; every tensor is checked (:meth:`check_specs`) before the first
        copy, so a bad bucket changes nothing."""
        named = list(named)
        self.check_specs((n, t.shape, t.dtype) for n, t in named)
        for name, t in named:
            p = self._params[name]
            p.data.copy_(t.to(device=p.device, dtype=p.dtype))
        return len(named)

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def named_weights(self):
        """The engine's current tensors, for ``sync.check_equal``."""
        return self.model.state_dict()

    # ------------------------------------------------------------------------------------- memory
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        tags = check_tags(tags)
        with self._lock:
            if self._fast is not None:
                if "kv_cache" in tags:
                    self._fast.free_cache()  # also drops the graphs (they point into the cache)
                if "cuda_graph" in tags or "weights" in tags:  # moved weights invalidate captured graphs
                    self._fast.drop_graphs()
                self._fast.graphs_released |= "cuda_graph" in tags
            if "weights" in tags and "weights" not in self._released and self.device.type == "cuda":
                self._weights_memory().offload(["weights"])  # to pinned host buffers allocated once
            self._released |= set(tags)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        tags = check_tags(tags)
        with self._lock:
            if "weights" in tags and "weights" in self._released and self.device.type == "cuda":
                self._weights_memory().onload(["weights"])  # the same tensor objects: _params stays valid
            if self._fast is not None:
                if "kv_cache" in tags:
                    self._fast.restore_cache()
                if "cuda_graph" in tags:
                    self._fast.graphs_released = False  # graphs are captured again on first use
            self._released -= set(tags)

    def _weights_memory(self):
        """The model's parameters and buffers through megaforge.memory's copy engine (pinned host
        buffers allocated at the first release, chunked copies on a side stream; tensor identities
        kept, so the fast path's references and ``_params`` stay valid)."""
        if getattr(self, "_wmem", None) is None:
            def entries(tags):
                seen = {id(t): t for t in list(self.model.parameters()) + list(self.model.buffers())}
                return [Entry(t, "weights") for t in seen.values() if t.device == self.device]

            self._wmem = PinnedOffloader(entries, self.device)
        return self._wmem

    @property
    def released(self) -> set[str]:
        return set(self._released)

    @property
    def aborting(self) -> bool:
        """True from :meth:`abort` until the next :meth:`generate` starts."""
        return self._abort.is_set()

    def abort(self) -> None:
        self._abort.set()

    def health(self) -> bool:
        return "weights" not in self._released

    def shutdown(self) -> None:
        self._abort.set()
