#!/usr/bin/env python
"""Each system's own per-step log turned into the common schema (tools/peers/schema.py).

    python tools/peers/parse_logs.py megaforge RUN/metrics.jsonl --run hold1 [--stamps S --launch_t T] --out mf.jsonl
    python tools/peers/parse_logs.py verl VERL_FILE_LOGGER.jsonl --run hold1-mapped [--stamps S --launch_t T] --out verl.jsonl
    python tools/peers/parse_logs.py verl console.log ...      # verl's console lines "step:N - key:value - ..."
    python tools/peers/parse_logs.py evaluate EVAL.jsonl --system verl --step 10 --run hold1 --out eval.jsonl [--model HF_DIR]

megaforge (``metrics.jsonl``): ``rollout_s`` = ``time/rollout``, ``reward_s`` = ``time/reward_wait``,
``train_s`` = ``time/train``, ``pi_old_s`` = ``time/train/pi_old`` (0 in a step without a pi_old pass: one
update a batch), ``update_s`` = ``time/train/update`` (both null in logs written before these keys), ``sync_s`` =
``time/sync + time/release + time/onload + time/offload + time/resume``, ``step_s`` = ``time/step``,
``tokens`` = ``throughput/tokens_per_s * time/step``; evaluation rows (``eval/<set>/greedy/pass@1``)
become ``eval`` records.

verl 0.9.1 (the file logger's ``{"step": N, "data": {...}}`` lines, ``trainer.logger=[console,file]``
with ``VERL_FILE_LOGGER_PATH``; or its console lines): ``rollout_s`` = ``timing_s/gen`` (the v1 sync
trainer's ``gen`` also puts SGLang to sleep), ``reward_s`` = ``timing_s/reward``, ``pi_old_s`` =
``timing_s/old_log_prob``, ``update_s`` = ``timing_s/update_actor``, ``sync_s`` = ``timing_s/update_weights``
(+ ``switch_to_*``), ``step_s`` = ``timing_s/step - timing_s/save_checkpoint`` (verl times its checkpoint
inside the step; megaforge's is outside), ``tokens`` = ``perf/total_num_tokens``; ``val-core/*/acc/mean@1``
becomes an ``eval`` record with ``source`` ``verl-val`` (a cross-check: the comparison grades with
tools/evaluate.py).

Start-up: ``--stamps`` is the file tools/peers/stamp.py wrote while the log grew (the epoch time each
line appeared) and ``--launch_t`` the epoch time of the launch; ``startup_s`` = (time the first step's line
appeared - that step's ``step_s``) - ``launch_t``: to the first step's start, including any evaluation
before it (named in ``includes``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schema import step_record, with_wall, write  # noqa: E402

MF_SYNC = ("time/sync", "time/release", "time/onload", "time/offload", "time/resume")


def _num(d: dict, k: str):
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_stamps(path: str) -> dict[int, float]:
    """{line number (1-based): epoch seconds it appeared} from stamp.py's output."""
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[int(r["line"])] = float(r["t"])
    return out


def _startup(system: str, run: str, first: dict, first_line: int, stamps, launch_t, includes: str) -> list[dict]:
    if stamps is None or launch_t is None or first_line not in stamps:
        return []
    t = stamps[first_line] - first["step_s"] - launch_t
    return [{"kind": "startup", "system": system, "run": run, "startup_s": max(t, 0.0), "includes": includes}]


def megaforge_records(path: str, run: str, n_gpus: int = 1, stamps=None, launch_t=None) -> list[dict]:
    """Schema records of a megaforge run's ``metrics.jsonl``."""
    recs, first, first_line, before = [], None, None, ""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            step = int(r["step"])
            for k, v in r.items():
                m = re.fullmatch(r"eval/([^/]+)/greedy/pass@1", k)
                if m:
                    recs.append({"kind": "eval", "system": "megaforge", "run": run, "step": step, "pass1": float(v),
                                 "prompts": _num(r, f"eval/{m.group(1)}/prompts"), "set": m.group(1),
                                 "source": "megaforge-eval"})
                    if first is None:
                        before = "eval before training"
            if "time/step" not in r:
                continue
            parts = [_num(r, k) for k in MF_SYNC]
            tps = _num(r, "throughput/tokens_per_s")
            rec = step_record("megaforge", run, step, step_s=float(r["time/step"]), n_gpus=n_gpus,
                              rollout_s=_num(r, "time/rollout"), reward_s=_num(r, "time/reward_wait"),
                              train_s=_num(r, "time/train"), **_mf_train_parts(r),
                              sync_s=sum(p for p in parts if p is not None) if any(p is not None for p in parts) else None,
                              tokens=tps * float(r["time/step"]) if tps is not None else None)
            if first is None:
                first, first_line = rec, i
            recs.append(rec)
    if first is not None:
        recs += _startup("megaforge", run, first, first_line, stamps, launch_t, before)
    return with_wall(recs)


def _mf_train_parts(r: dict) -> dict:
    """pi_old_s / update_s of a megaforge metrics row: ``time/train/pi_old`` (0.0 when the step ran no
    pi_old pass) and ``time/train/update``; None for both in a log without the parts."""
    if "time/train/update" not in r:
        return {"pi_old_s": None, "update_s": None}
    return {"pi_old_s": float(r.get("time/train/pi_old", 0.0)), "update_s": float(r["time/train/update"])}


_CONSOLE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_VALUE = re.compile(r"(?:np\.\w+\()?([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))\)?")  # 1.5, np.float64(1.5)


def verl_rows(path: str):
    """(line number, step, metrics) of verl's file-logger JSON lines or console ``step:N - k:v`` lines."""
    with open(path, errors="replace") as f:
        for i, line in enumerate(f, 1):
            s = line.strip()
            if s.startswith("{"):
                try:
                    r = json.loads(s)
                except json.JSONDecodeError:
                    continue
                if isinstance(r, dict) and "step" in r and isinstance(r.get("data"), dict):
                    yield i, int(r["step"]), r["data"]
                continue
            m = _CONSOLE.search(s)
            if m:
                data = {}
                for item in m.group(2).split(" - "):
                    k, _, v = item.partition(":")
                    mv = _VALUE.fullmatch(v.strip())
                    if mv:
                        data[k.strip()] = float(mv.group(1))
                yield i, int(m.group(1)), data


def verl_records(path: str, run: str, n_gpus: int = 1, stamps=None, launch_t=None) -> list[dict]:
    """Schema records of verl 0.9.1's logged metrics (see the module docstring)."""
    recs, first, first_line, before = [], None, None, ""
    for i, step, d in verl_rows(path):
        for k, v in d.items():
            m = re.fullmatch(r"val-core/(.+)/acc/mean@1", k)
            if m and isinstance(v, (int, float)):
                recs.append({"kind": "eval", "system": "verl", "run": run, "step": step, "pass1": float(v),
                             "set": m.group(1), "source": "verl-val"})
                if first is None:
                    before = "verl val_before_train"
        if "timing_s/step" not in d:
            continue
        step_s = float(d["timing_s/step"]) - (_num(d, "timing_s/save_checkpoint") or 0.0)
        sync = [_num(d, k) for k in ("timing_s/update_weights", "timing_s/switch_to_trainer", "timing_s/switch_to_rollout")]
        rec = step_record("verl", run, step, step_s=step_s, n_gpus=n_gpus, rollout_s=_num(d, "timing_s/gen"),
                          reward_s=_num(d, "timing_s/reward"), pi_old_s=_num(d, "timing_s/old_log_prob"),
                          update_s=_num(d, "timing_s/update_actor"),
                          sync_s=sum(x for x in sync if x is not None) if any(x is not None for x in sync) else None,
                          tokens=_num(d, "perf/total_num_tokens"),
                          verl_throughput=_num(d, "perf/throughput"),
                          checkpoint_s=_num(d, "timing_s/save_checkpoint"))
        if first is None:
            first, first_line = rec, i
        recs.append(rec)
    if first is not None:
        recs += _startup("verl", run, first, first_line, stamps, launch_t, before)
    return with_wall(recs)


def evaluate_records(path: str, system: str, run: str, step: int, model=None) -> list[dict]:
    """``eval`` records of tools/evaluate.py's printed JSON line(s) (``eval/<set>/greedy/pass@1``);
    ``model``: only the line(s) of that ``--model`` folder (a several-``--model`` call prints one per model)."""
    recs = []
    with open(path) as f:
        for line in f:
            s = line.strip()
            if not s.startswith("{"):
                continue
            r = json.loads(s)
            if model is not None and os.path.abspath(r.get("model", "")) != os.path.abspath(model):
                continue
            for k, v in r.items():
                m = re.fullmatch(r"eval/([^/]+)/greedy/pass@1", k)
                if m:
                    recs.append({"kind": "eval", "system": system, "run": run, "step": step, "pass1": float(v),
                                 "prompts": _num(r, f"eval/{m.group(1)}/prompts"), "set": m.group(1),
                                 "source": "tools/evaluate.py"})
    return recs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("system", choices=["megaforge", "verl", "evaluate"])
    p.add_argument("log")
    p.add_argument("--run", required=True, help="label of the hold and variant, e.g. hold1-mapped")
    p.add_argument("--out", default="-")
    p.add_argument("--n_gpus", type=int, default=1)
    p.add_argument("--stamps", help="stamp.py's output for this log")
    p.add_argument("--launch_t", type=float, help="epoch seconds of the launch")
    p.add_argument("--system_of_eval", "--for", dest="for_system", default="megaforge",
                   help="evaluate: the system whose weights were evaluated")
    p.add_argument("--step", type=int, default=0, help="evaluate: the step of the evaluated weights")
    p.add_argument("--model", default=None,
                   help="evaluate: only the line of this --model folder (a several --model call prints one per model)")
    a = p.parse_args(argv)
    if not os.path.exists(a.log):
        print(f"megaforge: error: {a.log}: no such file", file=sys.stderr)
        return 2
    stamps = read_stamps(a.stamps) if a.stamps else None
    if a.system == "megaforge":
        recs = megaforge_records(a.log, a.run, a.n_gpus, stamps, a.launch_t)
    elif a.system == "verl":
        recs = verl_records(a.log, a.run, a.n_gpus, stamps, a.launch_t)
    else:
        recs = evaluate_records(a.log, a.for_system, a.run, a.step, a.model)
    if not recs:
        print(f"megaforge: error: {a.log}: no {a.system} records found", file=sys.stderr)
        return 1
    n = write(recs, a.out)
    print(f"[parse_logs] {n} records from {a.log}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
