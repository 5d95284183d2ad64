"""Per step of MoE runs without and with routing replay, one JSON line: the run's variant (its folder's
name), step, ``train_rollout_logprob_abs_diff``, ``routing/replay_diff_frac`` (null where the run did not record the engine's routing) and
``time/step`` from each ``metrics.jsonl`` given (tools/gpu/h200_session.sh, stage moe_replay). A missing
file prints one line with ``"error"``.

    python tools/gpu/replay_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl
"""
from __future__ import annotations

import json
import os
import sys

KEYS = ("train_rollout_logprob_abs_diff", "routing/replay_diff_frac", "time/step")


def main(paths: list[str]) -> int:
    for path in paths:
        variant = os.path.basename(os.path.dirname(os.path.abspath(path)))
        if not os.path.exists(path):
            print(json.dumps({"variant": variant, "error": f"no {path}"}))
            continue
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    print(json.dumps({"variant": variant, "step": row.get("step"), **{k: row.get(k) for k in KEYS}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
