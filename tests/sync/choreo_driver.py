"""A GRPO run (launched by test_choreography.py) with recorders around the real engine's HTTP clients and
the real trainer's offload/onload/iter_hf_buckets: every engine endpoint hit (with its memory tags and,
for /generate, the weight versions answered) and every trainer transition, in order, go to calls.json.

    python choreo_driver.py OUT_DIR CONFIG_OVERRIDES...
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    out = sys.argv[1]
    from megaforge.config import load_config
    from megaforge.loop import Run

    cfg = load_config(sys.argv[2:])
    calls: list = []
    run = Run(cfg, "grpo")

    def wrap_trainer(name):
        orig = getattr(run.trainer, name)

        def rec(*a, **kw):
            tags = a[0] if a else kw.get("tags")
            calls.append(["trainer", name, list(tags) if tags is not None else None, run.trainer.version])
            return orig(*a, **kw)
        setattr(run.trainer, name, rec)

    for name in ("offload", "onload"):
        wrap_trainer(name)
    orig_iter = run.trainer.iter_hf_buckets

    def iter_rec(max_bytes):
        calls.append(["trainer", "iter_hf_buckets", max_bytes, run.trainer.version])
        return orig_iter(max_bytes)
    run.trainer.iter_hf_buckets = iter_rec

    build = run._build_engine

    def build_rec():
        engine = build()
        for c in engine.clients:
            orig = c.request

            async def request(method, endpoint, payload=None, _orig=orig, **kw):
                ans = await _orig(method, endpoint, payload, **kw)
                entry = ["engine", endpoint, None]
                if endpoint in ("/release_memory_occupation", "/resume_memory_occupation"):
                    entry[2] = payload.get("tags")
                elif endpoint == "/generate":
                    items = ans if isinstance(ans, list) else [ans]
                    entry[2] = sorted({i["meta_info"]["weight_version"] for i in items})
                elif endpoint in ("/update_weights_from_tensor", "/update_weights_from_disk"):
                    entry[2] = payload.get("weight_version")
                calls.append(entry)
                return ans
            c.request = request
        return engine
    run._build_engine = build_rec
    run.rl()
    with open(os.path.join(out, "calls.json"), "w") as f:
        json.dump(calls, f)


if __name__ == "__main__":
    main()
