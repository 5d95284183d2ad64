"""The fast decode path of :class:`~megaforge.rollout.embedded.EmbeddedEngine`: a static KV cache,
continuous refill, and CUDA-graphed decode steps.

Per generate call (``B`` = slots = min(max_batch, requests) rounded up to a power of two):

    waiting requests --admit--> free slots: prefill (length-bucketed, identical prompts prefilled
        once and their K/V rows copied), first token sampled from the prefill logits
    loop: K decode steps on rows [0, Bb) (Bb: power-of-two bucket of the highest busy slot)
          attention over cache positions [0, Lb) (Lb: bucket of the longest busy row)
          each step = one CUDA graph replay (key (Bb, Lb, sampling stages)) on GPU, eager on CPU:
              forward one token per row -> sample (counter-based Gumbel noise) -> write token / logprob to
              out_tok / out_lp [B, K] at column ``step`` -> stop-token and max-token checks on GPU
          then ONE host copy: per-row counts, finished flags, the K tokens and logprobs;
          finished rows free their slots and waiting requests take them (continuous refill);
          with nobody waiting, busy rows are compacted into the lowest slots so Bb shrinks.

Sampling is :func:`~megaforge.rollout.embedded.sampling.sample_from_keys` (the simple engine's math: Gumbel-max
with counter-based noise) with the key ``counter_keys(seed, index of the generated token)``; a request
without a seed gets one drawn from the engine's seed generator, so every row is batch-independent.
With ``compile`` set, the draw (noise, argmax, logprob: one fused pass over the vocabulary) is compiled. Stop strings and aborts are
checked on the host at chunk boundaries (rows decoded past a stop string are truncated there).
"""
from __future__ import annotations

import heapq
import logging
from collections import deque
from typing import Optional, Sequence

import torch

from megaforge.rollout.embedded.fast.forward import StaticForward
from megaforge.rollout.embedded.sampling import counter_keys, draw_tokens, sample_from_keys, vocab_offsets
from megaforge.types import Completion, GenerateRequest

log = logging.getLogger(__name__)


def batch_bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, capped at ``cap``."""
    p = 1
    while p < n:
        p *= 2
    return min(p, cap)


def kv_bucket(n: int, cap: int) -> int:
    """Attention window >= n: multiples of 128 up to 512, then four buckets per doubling; <= cap."""
    g = 128 if n <= 512 else (1 << ((n - 1).bit_length() - 1)) // 4
    return min(-(-n // g) * g, cap)


def prefill_bucket(n: int, cap: int) -> int:
    """Padded prompt length >= n: a power of two (>= 16) up to 512, then multiples of 256; <= cap."""
    b = max(16, 1 << (n - 1).bit_length()) if n <= 512 else -(-n // 256) * 256
    return min(b, cap)


class SlotState:
    """Per-slot decoding state on the device, B slots, S stop tokens, K steps per chunk.

    tok [B] next input token, lens [B] tokens in the cache (= the next write position), ngen [B]
    tokens generated, maxnew [B], fin [B] bool, temp / topp float [B], topk [B], seed [B],
    stops [B, S] (-1 padded), out_tok / out_lp [B, K] this chunk's tokens and logprobs, step [1].
    """

    ROW = ("tok", "lens", "ngen", "maxnew", "fin", "temp", "topk", "topp", "seed", "stops")

    def __init__(self, B: int, S: int, K: int, device):
        L, F = dict(dtype=torch.long, device=device), dict(dtype=torch.float32, device=device)
        self.B, self.S, self.K = B, S, K
        self.tok, self.lens, self.ngen = torch.zeros(B, **L), torch.zeros(B, **L), torch.zeros(B, **L)
        self.maxnew = torch.ones(B, **L)
        self.fin = torch.ones(B, dtype=torch.bool, device=device)
        self.temp, self.topp = torch.ones(B, **F), torch.ones(B, **F)
        self.topk, self.seed = torch.full((B,), -1, **L), torch.zeros(B, **L)
        self.stops = torch.full((B, S), -1, **L)
        self.out_tok, self.out_lp = torch.zeros(B, K, **L), torch.zeros(B, K, **F)
        self.step = torch.zeros(1, **L)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for name in self.ROW:
            t = getattr(self, name)
            t[dst] = t[src]
        self.fin[src] = True


class FastDecoder:
    """Static-cache decoding for an :class:`EmbeddedEngine` (its model, tokenizer, pad id, abort flag).

    chunk: decode steps between host copies; graphs: CUDA graphs (None: on CUDA devices);
    prefill_tokens: padded prompt tokens per prefill forward; memory_fraction: on CUDA, the slots
    (their K/V rows plus the sampling buffers of a step) take at most this fraction of the free
    device memory: fewer slots than requested means more refill rounds, not an out-of-memory error;
    compile: a torch.compile backend for the decode step's per-layer pieces (forward.py; GPU:
    "inductor") and the sampler's draw (sampling.draw_tokens), None: both run eagerly; attention: "auto" | "sdpa" | "matmul", how a
    decode step attends (forward.py).
    """

    def __init__(self, engine, chunk: int = 32, graphs: Optional[bool] = None, prefill_tokens: int = 32768,
                 memory_fraction: float = 0.5, compile: Optional[str] = None, attention: str = "auto"):
        self.engine = engine
        self.fwd = StaticForward(engine.model, compile=compile, attention=attention)
        self._draw, self._keys = draw_tokens, counter_keys
        if compile:  # the draw: one fused pass over the vocabulary; the keys: one kernel, not 14
            self._draw, self._keys = (torch.compile(f, backend=compile, dynamic=True, fullgraph=True)
                                      for f in (draw_tokens, counter_keys))
        self.device = engine.device
        self.use_graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("fast rollout path: CUDA graphs need a CUDA device")
        self.chunk = int(chunk)
        self.prefill_tokens = int(prefill_tokens)
        self.memory_fraction = float(memory_fraction)
        self._side = None
        self.vocab = engine.model.lm_head.weight.shape[0]
        self._offsets = vocab_offsets(self.vocab, self.device)  # the draw's per-token stream steps
        self.cache = None
        self.slots: Optional[SlotState] = None
        self._shape: Optional[tuple[int, int, int]] = None  # (B, L, S) of the allocation
        self.graphs: dict = {}
        self._eager_keys: set = set()
        self._pool = None
        self.graphs_released = False
        self._seed_gen = torch.Generator().manual_seed(0)
        self.stats = dict(prefill_calls=0, prefilled_prompts=0, shared_prefills=0, decode_steps=0, chunks=0,
                          graph_captures=0, graph_failures=0, compactions=0, max_busy=0, cache_bytes=0)

    # ------------------------------------------------------------------------------ allocation
    def _ensure(self, B_need: int, L_need: int, S_need: int) -> None:
        B = batch_bucket(B_need, self.engine.max_batch)
        L = -(-L_need // 128) * 128
        S = max(S_need, 4)
        if self._shape is not None:
            oB, oL, oS = self._shape
            if self.cache is not None and oL >= L and oS >= S and (oB >= B or self._fit(B, L) <= oB):
                return  # big enough (or as big as memory allows: refill does the rest)
            B, L, S = max(B, oB), max(L, oL), max(S, oS)
        self._allocate(self._fit(B, L), L, S)

    def _fit(self, B: int, L: int) -> int:
        """Slots (<= B) whose K/V rows of length L and per-step sampling buffers fit the memory budget
        (free device memory, plus what this process's allocator holds unused, plus our own cache)."""
        if self.device.type != "cuda":
            return B
        free = torch.cuda.mem_get_info(self.device)[0]
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if self.cache is not None:
            free += self.cache.nbytes
        # sampling per vocabulary entry: the logits (<= 4 B), their float32 scaled copy (4 B) and the eager
        # draw's in-place noise (sampling.gumbel_noise: at most three 8-byte tensors and a mask, 25 B);
        # compiled, the draw keeps none of them
        per_row = L * self.fwd.kv_bytes_per_token + 33 * self.vocab
        fit = max(1, int(self.memory_fraction * free) // per_row)
        if fit < B:
            log.warning("fast rollout path: %d slots of %d tokens fit in %.0f%% of the free GPU memory (asked %d)",
                        fit, L, 100 * self.memory_fraction, B)
        return min(B, fit)

    def _allocate(self, B: int, L: int, S: int) -> None:
        self.free_cache()
        self.cache = self.fwd.new_cache(B, L, self.device)
        self.slots = SlotState(B, S, self.chunk, self.device)
        self._shape = (B, L, S)
        self.stats["cache_bytes"] = self.cache.nbytes

    def free_cache(self) -> None:
        """Drop the static cache, the slot state and the graphs (their shape is kept for :meth:`restore_cache`)."""
        self.drop_graphs()
        self.cache = self.slots = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_cache(self) -> None:
        if self.cache is None and self._shape is not None:
            self._allocate(*self._shape)

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self._eager_keys.clear()
        self._pool = None

    # ------------------------------------------------------------------------------- decoding
    @torch.no_grad()
    def _step_body(self, Bb: int, Lb: int, flags: tuple) -> None:
        """One decode step of rows [0, Bb) (see the module docstring); no host synchronisation."""
        s = self.slots
        need_k, need_p, greedy = flags
        active = ~s.fin[:Bb]
        logits = self.fwd.decode(self.cache, s.tok[:Bb], s.lens[:Bb], Lb)
        keys = self._keys(s.seed[:Bb], s.ngen[:Bb])
        tok, lp = sample_from_keys(logits, s.temp[:Bb], s.topk[:Bb], s.topp[:Bb], keys, need_k, need_p, greedy,
                                   draw=self._draw, offsets=self._offsets)
        col = s.step.expand(Bb)[:, None]
        s.out_tok[:Bb].scatter_(1, col, tok[:, None])
        s.out_lp[:Bb].scatter_(1, col, lp[:, None].float())
        inc = active.long()
        s.ngen[:Bb].add_(inc)
        s.lens[:Bb].add_(inc)
        stop = (tok[:, None] == s.stops[:Bb]).any(-1)
        s.fin[:Bb] |= active & (stop | (s.ngen[:Bb] >= s.maxnew[:Bb]))
        s.tok[:Bb].copy_(torch.where(active, tok, torch.full_like(tok, self.engine.pad_id)))
        s.step.add_(1)

    def _step(self, Bb: int, Lb: int, flags: tuple) -> None:
        key = (Bb, Lb, flags)
        if not self.use_graphs or self.graphs_released or key in self._eager_keys:
            self._step_body(Bb, Lb, flags)
            return
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        # first use of this bucket: the real step runs eagerly on a side stream (warm-up), then the
        # same step is captured (capture records, it does not run)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step_body(Bb, Lb, flags)
        torch.cuda.current_stream(self.device).wait_stream(side)
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                self._step_body(Bb, Lb, flags)
            self.graphs[key] = g
            self.stats["graph_captures"] += 1
        except Exception as e:  # keep decoding eagerly for this bucket rather than fail the rollout
            log.warning("fast rollout path: CUDA graph capture failed for %s (%s); eager steps", key, e)
            self._eager_keys.add(key)
            self.stats["graph_failures"] += 1

    # ------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, reqs: Sequence[GenerateRequest]) -> list[Completion]:
        eng = self.engine
        n = len(reqs)
        if n == 0:
            return []
        sp = [r.sampling for r in reqs]
        if any(p.stop for p in sp) and eng.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        greedy = [p.temperature <= 0 for p in sp]
        flags = (any(0 < p.top_k < self.vocab for p in sp), any(p.top_p < 1.0 for p in sp),
                 "all" if all(greedy) else ("some" if any(greedy) else "none"))
        drawn = torch.randint(0, 2 ** 62, (n,), generator=self._seed_gen).tolist()
        run = _Run(self, reqs, flags, [int(p.seed) if p.seed is not None else d for p, d in zip(sp, drawn)])
        self._ensure(min(n, eng.max_batch), max(len(r.input_ids) + run.maxnew[i] for i, r in enumerate(reqs)),
                     max([len(p.stop_token_ids) for p in sp] + [1]))
        return run.loop()


class _Run:
    """Host-side bookkeeping of one generate call over a :class:`FastDecoder`'s slots."""

    def __init__(self, dec: FastDecoder, reqs, flags, seeds):
        self.dec, self.reqs, self.flags, self.seeds = dec, reqs, flags, seeds
        self.eng = dec.engine
        self.maxnew = [max(1, r.sampling.max_new_tokens) for r in reqs]
        self.stopset = [set(r.sampling.stop_token_ids) for r in reqs]
        n = len(reqs)
        self.out_ids: list[list[int]] = [[] for _ in range(n)]
        self.out_lp: list[list[float]] = [[] for _ in range(n)]
        self.reason: list[Optional[str]] = [None] * n
        self.waiting = deque(range(n))

    def loop(self) -> list[Completion]:
        dec, s = self.dec, self.dec.slots
        cap = min(s.B, self.eng.max_batch)
        self.slot_req = [-1] * cap
        self.free = list(range(cap))
        s.fin.fill_(True)
        while True:
            if self.eng.aborting:
                for r in range(len(self.reqs)):
                    if self.reason[r] is None:
                        self.reason[r] = "abort"
                break
            if self.waiting and self.free:
                self._admit()
                self.eng.mark_progress()  # the admitted rows' first tokens (a 1-token request ends here)
            busy = [i for i, r in enumerate(self.slot_req) if r >= 0]
            if not busy:
                if self.waiting:
                    continue
                break
            if not self.waiting:
                busy = self._compact(busy)
            dec.stats["max_busy"] = max(dec.stats["max_busy"], len(busy))
            self._chunk(busy)
            self.eng.mark_progress()
        return [Completion(r.rid, self.out_ids[i], self.out_lp[i], self.reason[i] or "length", self.eng.weight_version,
                           self.eng.tokenizer.decode(self.out_ids[i], skip_special_tokens=False)
                           if self.eng.tokenizer is not None else "")
                for i, r in enumerate(self.reqs)]

    # --------------------------------------------------------------------------------- host side
    def _lens(self, r: int) -> int:
        return len(self.reqs[r].input_ids) + len(self.out_ids[r]) - 1

    def _append(self, r: int, toks: list[int], lps: list[float], gpu_fin: bool) -> bool:
        """Append a row's new tokens; True when the request is finished (reason set)."""
        stops = self.reqs[r].sampling.stop
        if stops:
            for t, lp in zip(toks, lps):
                self.out_ids[r].append(t)
                self.out_lp[r].append(lp)
                if t in self.stopset[r] or self.eng.hit_stop_string(self.out_ids[r], stops):
                    self.reason[r] = "stop"
                    return True
        else:
            self.out_ids[r].extend(toks)
            self.out_lp[r].extend(lps)
        if gpu_fin or len(self.out_ids[r]) >= self.maxnew[r] or (self.out_ids[r] and self.out_ids[r][-1] in self.stopset[r]):
            self.reason[r] = "stop" if self.out_ids[r][-1] in self.stopset[r] else "length"
            return True
        return False

    def _release(self, slots: list[int]) -> None:
        for i in slots:
            self.slot_req[i] = -1
            heapq.heappush(self.free, i)
        if slots:
            self.dec.slots.fin[torch.tensor(slots, device=self.dec.device)] = True

    # ------------------------------------------------------------------------------------ admit
    def _admit(self) -> None:
        dec, s = self.dec, self.dec.slots
        dev = dec.device
        m = min(len(self.free), len(self.waiting))
        slots = [heapq.heappop(self.free) for _ in range(m)]
        rs = [self.waiting.popleft() for _ in range(m)]
        first: dict[tuple, int] = {}  # prompt -> row (in this admission) whose slot is prefilled
        src_row = []
        for j, r in enumerate(rs):
            src_row.append(first.setdefault(tuple(self.reqs[r].input_ids), j))
        uniq = sorted(set(src_row), key=lambda j: len(self.reqs[rs[j]].input_ids))
        logits_of: dict[int, torch.Tensor] = {}
        i = 0
        while i < len(uniq):  # prefill sub-batches under the padded-token budget
            T = prefill_bucket(len(self.reqs[rs[uniq[i]]].input_ids), dec.cache.L)
            k = 1
            while i + k < len(uniq):
                T2 = prefill_bucket(len(self.reqs[rs[uniq[i + k]]].input_ids), dec.cache.L)
                if (k + 1) * T2 > dec.prefill_tokens:
                    break
                T, k = T2, k + 1
            part = uniq[i:i + k]
            ids = torch.full((k, T), self.eng.pad_id, dtype=torch.long)
            for a, j in enumerate(part):
                p = self.reqs[rs[j]].input_ids
                ids[a, :len(p)] = torch.tensor(p, dtype=torch.long)
            lengths = torch.tensor([len(self.reqs[rs[j]].input_ids) for j in part])
            out = dec.fwd.prefill(dec.cache, ids.to(dev), lengths.to(dev), torch.tensor([slots[j] for j in part], device=dev))
            for a, j in enumerate(part):
                logits_of[j] = out[a]
            dec.stats["prefill_calls"] += 1
            dec.stats["prefilled_prompts"] += k
            i += k
        dups = [j for j in range(m) if src_row[j] != j]
        if dups:
            dec.cache.copy_rows(torch.tensor([slots[src_row[j]] for j in dups], device=dev),
                                torch.tensor([slots[j] for j in dups], device=dev),
                                max(len(self.reqs[rs[j]].input_ids) for j in dups))
            dec.stats["shared_prefills"] += len(dups)
        logits = torch.stack([logits_of[src_row[j]] for j in range(m)])
        sp = [self.reqs[r].sampling for r in rs]
        idx = torch.tensor(slots, device=dev)
        s.temp[idx] = torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev)
        s.topk[idx] = torch.tensor([p.top_k for p in sp], dtype=torch.long, device=dev)
        s.topp[idx] = torch.tensor([p.top_p for p in sp], dtype=torch.float32, device=dev)
        s.seed[idx] = torch.tensor([self.seeds[r] for r in rs], dtype=torch.long, device=dev)
        s.maxnew[idx] = torch.tensor([self.maxnew[r] for r in rs], dtype=torch.long, device=dev)
        stops = torch.full((m, s.S), -1, dtype=torch.long)
        for j, p in enumerate(sp):
            if p.stop_token_ids:
                stops[j, :len(p.stop_token_ids)] = torch.tensor(list(p.stop_token_ids), dtype=torch.long)
        s.stops[idx] = stops.to(dev)
        keys = dec._keys(s.seed[idx], torch.zeros(m, dtype=torch.long, device=dev))
        tok, lp = sample_from_keys(logits, s.temp[idx], s.topk[idx], s.topp[idx], keys, *self.flags, draw=dec._draw,
                                   offsets=dec._offsets)
        tok_l, lp_l = tok.tolist(), lp.float().tolist()
        done = []
        for j, r in enumerate(rs):
            self.slot_req[slots[j]] = r
            if self._append(r, [tok_l[j]], [lp_l[j]], False):
                done.append(j)
        fin = torch.zeros(m, dtype=torch.bool)
        fin[done] = True
        s.tok[idx] = tok
        s.lens[idx] = torch.tensor([len(self.reqs[r].input_ids) for r in rs], device=dev)
        s.ngen[idx] = 1
        s.fin[idx] = fin.to(dev)
        self._release([slots[j] for j in done])

    # ---------------------------------------------------------------------------------- compact
    def _compact(self, busy: list[int]) -> list[int]:
        """Move busy rows into the lowest slots when that shrinks the batch bucket; returns the busy slots."""
        dec = self.dec
        c = len(busy)
        cap = len(self.slot_req)
        if batch_bucket(c, cap) >= batch_bucket(busy[-1] + 1, cap):
            return busy
        src = [i for i in busy if i >= c]
        dst = [i for i in range(c) if self.slot_req[i] < 0]
        dev = dec.device
        st, dt = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        dec.cache.copy_rows(st, dt, max(self._lens(self.slot_req[i]) for i in src) + 1)
        dec.slots.move_rows(st, dt)
        for a, b in zip(src, dst):
            self.slot_req[b], self.slot_req[a] = self.slot_req[a], -1
        self.free = [i for i in range(cap) if self.slot_req[i] < 0]
        heapq.heapify(self.free)
        dec.stats["compactions"] += 1
        return list(range(c))

    # ------------------------------------------------------------------------------------ chunk
    def _chunk(self, busy: list[int]) -> None:
        dec, s = self.dec, self.dec.slots
        cap = len(self.slot_req)
        Bb = batch_bucket(busy[-1] + 1, cap)
        rem = {i: self.maxnew[self.slot_req[i]] - len(self.out_ids[self.slot_req[i]]) for i in busy}
        steps = min(dec.chunk, max(rem.values()))
        Lb = kv_bucket(max(self._lens(self.slot_req[i]) + min(steps, rem[i]) for i in busy), dec.cache.L)
        s.step.zero_()
        for _ in range(steps):
            dec._step(Bb, Lb, self.flags)
        dec.stats["decode_steps"] += steps
        dec.stats["chunks"] += 1
        ngen = s.ngen[:Bb].tolist()  # the one synchronisation of the chunk
        fin = s.fin[:Bb].tolist()
        toks = s.out_tok[:Bb, :steps].tolist()
        lps = s.out_lp[:Bb, :steps].tolist()
        done = []
        for i in busy:
            r = self.slot_req[i]
            k = ngen[i] - len(self.out_ids[r])
            if self._append(r, toks[i][:k], lps[i][:k], fin[i]):
                done.append(i)
        self._release(done)
