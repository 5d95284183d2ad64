"""Partial rollouts: generation in budgeted rounds, unfinished samples carried across steps.

A *round* asks the engine for at most ``b = loop.partial_budget_tokens`` new tokens for every
unfinished sample (episode). An episode whose round ends by the budget (finish ``length`` with fewer
than ``rollout.max_new_tokens`` tokens) or by an engine abort stays unfinished; its next round
resubmits ``prompt + response so far`` as the prompt, asking for ``min(b, max_new_tokens - |response|)``
tokens. A group (the n samples of one prompt) is *finished* when all its episodes are.

One call of :meth:`PartialPool.generate` (one call per generation round of the loop's ``_rollout``)
returns ``n_groups`` finished groups:

1. finished groups carried from earlier calls, oldest first;
2. then rounds, each drawing ``n_groups - returned`` *new* prompts (unfinished groups do not count:
   they may be the long tail) and continuing every unfinished episode, until enough groups finished
   or ``ceil(max_new_tokens / b)`` rounds ran (so a group drawn in the first round has finished). At
   least one round runs whenever episodes are unfinished, so carried work always progresses.

Groups finished beyond ``n_groups`` are carried to the next call. Every drawn sample is therefore
returned exactly once (``partial/groups_*`` counters: drawn = returned + pending).

Token versions and the loss mask of a returned sample, with ``v_t`` the weight version that sampled
response token t and ``V`` the trainer version at which the batch trains (``train_version``, set by
the loop before the rollout; an upper bound when the rollout runs ahead):

* ``loop.partial_old_tokens: mask``: tokens with ``v_t < max_t v_t`` (generated before the sample's
  last weight update) get ``response_mask`` 0: they stay in the context but are not trained.
  ``correct``: they are trained, importance-corrected by the loss's TIS/MIS weights from their
  recorded rollout logprobs.
* either way, tokens with ``V - v_t > loop.max_staleness`` get ``response_mask`` 0.
* ``Sample.weight_version = min v_t`` over the still-trained tokens, so the loop's staleness
  ``V - weight_version`` bounds every trained token.

Stop strings are matched within a round's output (a stop string split across two rounds is missed);
stop token ids always work. The pool's whole state (:meth:`state_dict`) is plain JSON: a checkpoint
keeps unfinished work and a resumed run continues it exactly.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from megaforge.types import GenerateRequest, Sample, SamplingParams


@dataclass
class Episode:
    j: int  # sample index in its group
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version of each response token
    finish: Optional[str] = None  # None while unfinished; stop | length
    segments: int = 0  # rounds that added tokens


@dataclass
class Group:
    gid: int  # global draw number, stable across steps
    prompt_ids: list[int]
    prompt_text: str
    label: object
    episodes: list[Episode]

    @property
    def finished(self) -> bool:
        return all(e.finish is not None for e in self.episodes)


def segment_seed(seed: int, gid: int, j: int, start: int) -> int:
    """Sampling seed of the segment of episode (gid, j) that starts at response position ``start``."""
    h = hashlib.blake2b(f"partial/{seed}/{gid}/{j}/{start}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF


class PartialPool:
    """Unfinished and finished-but-unreturned groups, and the rounds that advance them (main rank).
    ``loop``: the LoopConfig section (``partial_budget_tokens``, ``max_staleness``, ``partial_old_tokens``);
    ``n_samples``: ``grpo.n_samples``; ``max_new_tokens``: ``rollout.max_new_tokens``; ``seed``: the run's."""

    def __init__(self, engine, data, tokenizer, loop, n_samples: int, max_new_tokens: int, seed: int,
                 score_fn: Callable[[list, dict], list], base: SamplingParams):
        self.engine, self.data, self.tokenizer, self.seed = engine, data, tokenizer, seed
        self.score_fn, self.base = score_fn, base
        self.n = n_samples
        self.max_new = max_new_tokens
        self.budget = loop.partial_budget_tokens or max(1, self.max_new // 2)
        self.max_rounds = math.ceil(self.max_new / self.budget)
        self.K, self.mode = loop.max_staleness, loop.partial_old_tokens
        self.inflight: list[Group] = []  # groups with an unfinished episode, oldest first
        self.ready: list[Group] = []  # finished groups not returned yet, oldest first
        self.next_gid = 0
        self.returned = 0  # groups returned, cumulative
        self.train_version = 0

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"inflight": [asdict(g) for g in self.inflight], "ready": [asdict(g) for g in self.ready],
                "next_gid": self.next_gid, "returned": self.returned}

    def load_state_dict(self, st: dict) -> None:
        def group(d):
            return Group(d["gid"], list(d["prompt_ids"]), d["prompt_text"], d["label"],
                         [Episode(**e) for e in d["episodes"]])

        self.inflight = [group(d) for d in st["inflight"]]
        self.ready = [group(d) for d in st["ready"]]
        self.next_gid, self.returned = int(st["next_gid"]), int(st["returned"])

    @property
    def pending_groups(self) -> int:
        return len(self.inflight) + len(self.ready)

    # ---------------------------------------------------------------------------------- generate
    def generate(self, step: int, n_groups: int, offset: int, m: dict) -> list[Sample]:
        """``n_groups`` finished groups (fewer only if the rounds ran out) as scored samples, group ids
        ``offset, offset + 1, ...``; see the module docstring."""
        t0 = time.perf_counter()
        out = self._take(n_groups)
        rounds = 0
        while (len(out) < n_groups or (rounds == 0 and self.inflight)) and (rounds < self.max_rounds or not out):
            if rounds >= 4 * self.max_rounds:
                raise RuntimeError(f"partial rollouts: no group finished in {rounds} rounds (engine aborting every request?)")
            new = n_groups - len(out)
            if new > 0:
                self._draw(new)
            self._round(m)
            rounds += 1
            still = []
            for g in self.inflight:
                (self.ready if g.finished else still).append(g)
            self.inflight = still
            out += self._take(n_groups - len(out))
        samples = self._samples(out, offset, m)
        m["time/rollout"] = m.get("time/rollout", 0.0) + time.perf_counter() - t0
        self.score_fn(samples, m)
        m["partial/rounds"] = m.get("partial/rounds", 0.0) + rounds
        m["partial/carried_samples"] = float(sum(e.finish is None for g in self.inflight for e in g.episodes))
        m["partial/groups_drawn_total"] = float(self.next_gid)
        m["partial/groups_returned_total"] = float(self.returned)
        m["partial/groups_pending"] = float(self.pending_groups)
        return samples

    def _take(self, k: int) -> list[Group]:
        out, self.ready = self.ready[:max(k, 0)], self.ready[max(k, 0):]
        self.returned += len(out)
        return out

    def _draw(self, k: int) -> None:
        for row in self.data.next_batch(k):
            self.inflight.append(Group(self.next_gid, list(row.prompt_ids), row.prompt_text, row.label,
                                       [Episode(j) for j in range(self.n)]))
            self.next_gid += 1

    def _round(self, m: dict) -> None:
        """One budgeted generation for every unfinished episode (one engine batch)."""
        todo: list[tuple[Group, Episode]] = [(g, e) for g in self.inflight for e in g.episodes if e.finish is None]
        reqs = []
        for g, e in todo:
            start = len(e.response_ids)
            sp = SamplingParams(**{**self.base.__dict__, "max_new_tokens": min(self.budget, self.max_new - start),
                                   "seed": segment_seed(self.seed, g.gid, e.j, start)})
            reqs.append(GenerateRequest(g.prompt_ids + e.response_ids, sp, rid=f"p{g.gid}-n{e.j}-t{start}"))
        comps = self.engine.generate(reqs) if reqs else []
        cont = 0
        for (g, e), c in zip(todo, comps):
            cont += bool(e.response_ids) and bool(c.output_ids)
            e.response_ids += list(c.output_ids)
            e.logprobs += list(c.output_logprobs)
            e.versions += [int(c.weight_version)] * len(c.output_ids)
            e.segments += bool(c.output_ids)
            if c.finish_reason == "stop":
                e.finish = "stop"
            elif len(e.response_ids) >= self.max_new:
                e.finish = "length"
            # else: cut by the budget (length) or aborted: continued in a later round
        m["partial/continued_samples"] = m.get("partial/continued_samples", 0.0) + cont

    def _samples(self, groups: list[Group], offset: int, m: dict) -> list[Sample]:
        V, out = self.train_version, []
        old = stale = 0
        for i, g in enumerate(groups):
            for e in g.episodes:
                mask = [1] * len(e.response_ids)
                newest = max(e.versions, default=V)
                for t, v in enumerate(e.versions):
                    if self.mode == "mask" and v < newest:
                        mask[t], old = 0, old + 1
                    elif V - v > self.K:
                        mask[t], stale = 0, stale + 1
                trained = [v for v, k in zip(e.versions, mask) if k]
                out.append(Sample(
                    prompt_ids=list(g.prompt_ids), response_ids=list(e.response_ids), rollout_logprobs=list(e.logprobs),
                    group_id=offset + i, finish_reason=e.finish or "length", weight_version=min(trained, default=newest),
                    response_mask=mask, prompt_text=g.prompt_text, label=g.label,
                    response_text=self.tokenizer.decode(e.response_ids, skip_special_tokens=True),
                    metadata={"uid": f"{g.gid}:{e.j}", "segments": e.segments,
                              "oldest_version": min(e.versions, default=newest)}))
        m["partial/masked_old_tokens"] = m.get("partial/masked_old_tokens", 0.0) + old
        m["staleness/masked_tokens"] = m.get("staleness/masked_tokens", 0.0) + stale
        return out
