"""The per-step JSON line schema every system of the side-by-side comparison is reduced to (issue 39).

One JSON object a line, three kinds (``kind``):

* ``step``: one RL step as megaforge counts it (64 prompts x 8 samples generated, then the updates on
  them; a TRL "step" of this schema is ``steps_per_generation / gradient_accumulation_steps`` = 4 of
  its optimizer steps). Keys (seconds unless said; ``None`` where the system does not measure the
  phase apart):

  ``step_s``      wall time of the whole step (rollout + reward + train + sync; evaluation excluded)
  ``rollout_s``   generation of the samples (megaforge ``time/rollout``, verl ``timing_s/gen``, TRL ``_generate``)
  ``reward_s``    scoring (megaforge ``time/reward_wait``: only the wait; verl ``timing_s/reward``; TRL
                  ``_calculate_rewards``)
  ``pi_old_s``    the old policy's log-probs (megaforge ``time/train/pi_old``, verl ``timing_s/old_log_prob``,
                  TRL's no-grad forward)
  ``update_s``    the optimizer updates (megaforge ``time/train/update``, verl ``timing_s/update_actor``)
  ``train_s``     pi_old + update (megaforge ``time/train``, which also holds a reference's or critic's
                  forwards when the recipe has them; the others ``pi_old_s + update_s``)
  ``sync_s``      weights to the engine plus offload / onload / release / resume of either side
                  (megaforge ``time/sync + release + onload + offload + resume``, verl ``timing_s/update_weights``;
                  TRL with HF generate: 0, no second copy of the weights)
  ``tokens``      prompt + response tokens of the step's samples
  ``tokens_per_s_per_gpu`` = ``tokens / (step_s * n_gpus)`` (verl's ``perf/throughput`` is this formula)
  ``n_gpus``, ``first`` (true for the run's first step: it pays compilation / graph capture),
  ``train_wall_s`` (the running sum of ``step_s`` up to and including this step)

* ``startup``: ``startup_s``, launch to the first step's start (verl: to the first step, after its
  ``val_before_train`` validation when on: then ``includes`` names it).
* ``eval``: ``step``, ``pass1`` (greedy pass@1), ``prompts``, ``source`` (``tools/evaluate.py`` for the
  comparison; a peer's own validation only as a cross-check).

Every line has ``system`` (``megaforge`` / ``verl`` / ``trl``) and ``run`` (a label naming the hold and
the variant, e.g. ``hold1-mapped``).
"""
from __future__ import annotations

import json
import math
from typing import Iterable, Iterator, Optional

SYSTEMS = ("megaforge", "verl", "trl")
KINDS = ("step", "startup", "eval")
STEP_KEYS = ("step_s", "rollout_s", "reward_s", "pi_old_s", "update_s", "train_s", "sync_s", "tokens",
             "tokens_per_s_per_gpu", "n_gpus", "first", "train_wall_s")
PHASES = ("step_s", "rollout_s", "reward_s", "pi_old_s", "update_s", "train_s", "sync_s", "tokens_per_s_per_gpu")
REQUIRED = {"step": ("step", "step_s", "n_gpus"), "startup": ("startup_s",), "eval": ("step", "pass1")}


class SchemaError(ValueError):
    """A line that is not a record of this schema; the message names the file and line."""


def check(rec: dict, where: str = "record") -> dict:
    """``rec`` when it is a valid record of this schema, else SchemaError naming ``where`` and the key."""
    if not isinstance(rec, dict):
        raise SchemaError(f"{where}: a record must be a JSON object")
    kind = rec.get("kind")
    if kind not in KINDS:
        raise SchemaError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if rec.get("system") not in SYSTEMS:
        raise SchemaError(f"{where}: system {rec.get('system')!r} is not one of {', '.join(SYSTEMS)}")
    for k in REQUIRED[kind]:
        if rec.get(k) is None:
            raise SchemaError(f"{where}: a {kind} record needs {k!r}")
    for k, v in rec.items():
        if k in PHASES or k in ("startup_s", "pass1", "tokens", "train_wall_s"):
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0):
                raise SchemaError(f"{where}: {k} must be a finite number >= 0 or null, got {v!r}")
    if kind == "eval" and not 0.0 <= rec["pass1"] <= 1.0:
        raise SchemaError(f"{where}: pass1 must lie in [0, 1], got {rec['pass1']!r}")
    return rec


def step_record(system: str, run: str, step: int, *, step_s: float, n_gpus: int = 1, rollout_s=None,
                reward_s=None, pi_old_s=None, update_s=None, train_s=None, sync_s=None, tokens=None,
                first: bool = False, train_wall_s=None, **extra) -> dict:
    """A ``step`` record; ``train_s`` defaults to ``pi_old_s + update_s`` when both are known, and
    ``tokens_per_s_per_gpu`` is ``tokens / (step_s * n_gpus)``."""
    if train_s is None and pi_old_s is not None and update_s is not None:
        train_s = pi_old_s + update_s
    tps = tokens / (step_s * n_gpus) if tokens is not None and step_s > 0 else None
    rec = {"kind": "step", "system": system, "run": run, "step": int(step), "step_s": step_s, "rollout_s": rollout_s,
           "reward_s": reward_s, "pi_old_s": pi_old_s, "update_s": update_s, "train_s": train_s, "sync_s": sync_s,
           "tokens": tokens, "tokens_per_s_per_gpu": tps, "n_gpus": n_gpus, "first": bool(first),
           "train_wall_s": train_wall_s}
    rec.update(extra)
    return check(rec, f"{system} step {step}")


def with_wall(records: list[dict]) -> list[dict]:
    """``records`` with ``train_wall_s`` (running sum of ``step_s`` in step order) and ``first`` set on
    the step records that lack them."""
    total = 0.0
    steps = sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["step"])
    for i, r in enumerate(steps):
        total += r["step_s"]
        if r.get("train_wall_s") is None:
            r["train_wall_s"] = total
        r["first"] = r.get("first") or i == 0
    return records


def write(records: Iterable[dict], path: str) -> int:
    """Write ``records`` (each checked) as JSON lines to ``path`` ('-': stdout); the count."""
    import sys
    n = 0
    f = sys.stdout if path == "-" else open(path, "w")
    try:
        for r in records:
            f.write(json.dumps(check(r)) + "\n")
            n += 1
    finally:
        if f is not sys.stdout:
            f.close()
    return n


def read(path: str) -> Iterator[dict]:
    """The checked records of a JSON lines file (blank lines skipped); SchemaError naming ``path:line``."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SchemaError(f"{path}:{i}: not JSON ({e.msg})") from None
            yield check(rec, f"{path}:{i}")


def median(xs: list[float]) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2
