"""Evaluation through the rollout engine: held-out prompts -> responses -> rewards -> metrics.

The responses come from the run's own engine through :func:`megaforge.rollout.manager.generate_samples`
(the same requests and, with ``rollout.generate_fn``, the same multi-turn rollout as training), so
every engine (embedded, embedded_server, sglang) evaluates the weights it serves. Per set:

    greedy   one response per prompt at temperature 0                     -> greedy/pass@1
    sampled  eval.n_samples responses per prompt (eval.temperature,       -> sampled/pass@k (unbiased)
             rollout.top_p / top_k), seeded per (prompt, sample) and the
             same at every evaluation (common random numbers across steps)

Each mode's requests go to the engine in calls of at most ``rollout.batch_size * grpo.n_samples``
requests (a training step's generation; the request seeds do not depend on it), and a ``stop``
callback (the run's stop signal) is asked before each call: when it says stop, the evaluation is
abandoned at once, returns None and writes nothing (the run defers it to its resumed run).

A response is correct when the reward ``eval.correct_reward`` (default: the first of rewards.functions)
is >= ``eval.correct_threshold``. Metrics (:func:`megaforge.eval.stats.summarize`) are returned as
``eval/<set>/<key>``; with ``eval.write_samples`` every response is written to
``<out_dir>/<set>/step_NNNNNN.jsonl`` (prompt, response, label, reward and its components, verdict).
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

from megaforge.eval.sets import EvalSet
from megaforge.eval.stats import SampleResult, summarize
from megaforge.rollout.manager import generate_samples
from megaforge.specs import EvalSettings, expect
from megaforge.types import SamplingParams

#: the ``step`` the evaluation's request seeds are derived from (training steps are >= 1)
EVAL_SEED_STEP = -1


class Evaluator:
    """Evaluates the configured sets with an engine (main rank). ``settings``: what it reads of the
    configuration (:class:`~megaforge.specs.EvalSettings`, built by
    :meth:`megaforge.build.RunBuilder.eval_settings`); ``rewards``: the run's RewardManager; ``out_dir``:
    where the per-sample files go (None: not written)."""

    def __init__(self, settings: EvalSettings, sets: list[EvalSet], tokenizer, rewards, stop_ids,
                 out_dir: Optional[str] = None):
        self.settings = expect(settings, EvalSettings, "Evaluator")
        self.sets, self.tokenizer, self.rewards = sets, tokenizer, rewards
        self.stop_ids = list(stop_ids)
        self.out_dir = out_dir if settings.eval.write_samples else None
        # the component that decides correctness, by its label (RewardManager's key for it)
        self.correct_name = settings.correct_name

    def _params(self, temperature: float) -> SamplingParams:
        return self.settings.sampling.params(self.stop_ids, temperature, self.settings.eval.max_new_tokens)

    def run(self, engine, step: int, stop: Optional[Callable[[], bool]] = None) -> Optional[dict]:
        """Every set at the weights ``engine`` serves: ``eval/<set>/...`` metrics, ``eval/weight_version``
        and ``time/eval``; None when ``stop()`` said stop before one of the engine calls (see the module doc)."""
        t0 = time.perf_counter()
        out: dict = {}
        for s in self.sets:
            done = self.evaluate_set(engine, s, step, stop)
            if done is None:
                return None
            out.update({f"eval/{s.name}/{k}": v for k, v in done[0].items()})
        out["eval/weight_version"] = float(engine.weight_version)
        out["time/eval"] = time.perf_counter() - t0
        return out

    def evaluate_set(self, engine, s: EvalSet, step: int,
                     stop: Optional[Callable[[], bool]] = None) -> Optional[tuple[dict, list[dict]]]:
        """Metrics of one set (keys without the ``eval/<set>/`` prefix) and its per-response records; None
        when ``stop()`` said stop before one of its engine calls (nothing written)."""
        st = self.settings
        e = st.eval
        modes = ([("greedy", 1, 0.0)] if e.greedy else []) + \
                ([("sampled", e.n_samples, e.temperature or st.sampling.temperature)] if e.n_samples else [])
        results: list[SampleResult] = []
        records: list[dict] = []
        errors = 0.0
        for mode, n, temp in modes:
            per_call = max(1, st.per_step_requests // n)  # prompts per engine call
            for first in range(0, len(s.rows), per_call):
                if stop is not None and stop():
                    return None
                samples = generate_samples(engine, s.rows[first:first + per_call], n, self._params(temp),
                                           st.seed, EVAL_SEED_STEP, first, self.tokenizer, st.generate)
                errors += self._score(samples, s, step, mode, n, first, results, records)
        metrics = summarize(results, len(s.rows), e.ks, e.n_samples or None)
        metrics["reward_errors"] = errors
        if self.out_dir is not None:
            write_jsonl(os.path.join(self.out_dir, s.name, f"step_{step:06d}.jsonl"), records)
        return metrics, records

    def _score(self, samples, s: EvalSet, step: int, mode: str, n: int, first: int, results: list, records: list) -> float:
        """Score ``samples`` (rows ``first``, ``first + 1``, ... of set ``s``, ``n`` each); append their
        SampleResults and records; returns the reward errors and timeouts."""
        totals, comps, m = self.rewards.score_components([x.prompt_text for x in samples],
                                                         [x.response_text for x in samples],
                                                         [x.label for x in samples])
        for k, x in enumerate(samples):
            c = {name: vals[k] for name, vals in comps.items()}
            reward = totals[k] + float(x.metadata.get("env_reward", 0.0))
            r = SampleResult(prompt_index=first + k // n, mode=mode, reward=reward, components=c,
                             correct=c[self.correct_name] >= self.settings.eval.correct_threshold,
                             response_len=len(x.response_ids), finish_reason=x.finish_reason)
            results.append(r)
            row = s.rows[r.prompt_index]
            records.append({"step": step, "set": s.name, "prompt_index": r.prompt_index, "where": row.where,
                            "mode": mode, "sample": k % n, "prompt": x.prompt_text, "response": x.response_text,
                            "label": row.label, "reward": reward, "components": c, "correct": r.correct,
                            "response_len": r.response_len, "finish_reason": r.finish_reason,
                            "weight_version": x.weight_version})
        return m["reward/errors"] + m["reward/timeouts"]


def write_jsonl(path: str, records: list[dict]) -> None:
    """``records`` as one JSON object per line, written to a temporary file and renamed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, default=str) + "\n")
    os.replace(tmp, path)
