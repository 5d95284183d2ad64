"""Check a LoRA run's outputs against its frozen base, bit for bit.

    python tools/check_lora_run.py RUN_DIR [--step N] [--base HF_DIR]

Needs the run's PEFT adapter folder ``RUN_DIR/adapter/step_N`` and its merged HF export
``RUN_DIR/hf/step_N`` (``--export_hf_every``; default N: the newest step that has both). The base is
``RUN_DIR/source_model`` (``model.path`` naming a run) or ``--base``. Every tensor of the export must
equal, bit for bit, ``merge_lora(W0, A, B, alpha / r)`` (megaforge.sync.adapters: the float32 W0 + s B A
both backends compute) for an adapted weight and ``W0`` for every other one: a base weight that moved
during the run (or adapters that do not match the export) fails. Then the folder is loaded with
``peft.PeftModel.from_pretrained(base, folder)`` and the run's reward/mean is summarised. Exit status 1
on a mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch


def _load_dir(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def newest_step(run: str) -> int:
    steps = [int(m.group(1)) for d in os.listdir(os.path.join(run, "adapter"))
             if (m := re.fullmatch(r"step_(\d+)", d)) and os.path.isdir(os.path.join(run, "hf", d))]
    if not steps:
        raise SystemExit(f"{run}: no step with both adapter/step_N and hf/step_N (run with --export_hf_every)")
    return max(steps)


def check(run: str, step: int, base_dir: str) -> tuple[int, int]:
    """(adapted weights, other weights) checked; AssertionError naming the first mismatching tensor."""
    from megaforge.sync.adapters import merge_lora

    base, merged = _load_dir(base_dir), _load_dir(os.path.join(run, "hf", f"step_{step}"))
    folder = os.path.join(run, "adapter", f"step_{step}")
    adapters = _load_dir(folder)
    with open(os.path.join(folder, "adapter_config.json")) as f:
        cfg = json.load(f)
    scale = cfg["lora_alpha"] / cfg["r"]
    assert set(merged) <= set(base), sorted(set(merged) - set(base))[:3]
    n_adapted = n_same = 0
    for name, w in merged.items():
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        a = adapters.get(f"base_model.model.{mod}.lora_A.weight") if mod else None
        if a is not None:
            want = merge_lora(base[name], a, adapters[f"base_model.model.{mod}.lora_B.weight"], scale)
            n_adapted += 1
        else:
            want = base[name]
            n_same += 1
        assert torch.equal(w, want), f"{name}: the export differs from {'W0 + s B A' if a is not None else 'the base'}"
    assert 2 * n_adapted == len(adapters), f"{len(adapters)} adapter tensors, {n_adapted} adapted weights exported"
    return n_adapted, n_same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--base", default="", help="the base HF folder (default: RUN/source_model)")
    args = ap.parse_args(argv)
    step = args.step if args.step is not None else newest_step(args.run)
    base_dir = args.base or os.path.join(args.run, "source_model")
    try:
        n_adapted, n_same = check(args.run, step, base_dir)
    except AssertionError as e:
        print(f"check_lora_run: MISMATCH at step {step}: {e}", file=sys.stderr)
        return 1
    print(f"step {step}: merged export == W0 + s B A bit for bit for {n_adapted} adapted weights, == W0 for the "
          f"{n_same} others (base {base_dir} unchanged)")
    import peft
    import transformers

    peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir),
                                   os.path.join(args.run, "adapter", f"step_{step}"))
    print("peft.PeftModel.from_pretrained(base, adapter folder): loaded")
    mfile = os.path.join(args.run, "metrics.jsonl")
    if os.path.exists(mfile):
        with open(mfile) as f:
            r = [row["reward/mean"] for row in map(json.loads, f) if "reward/mean" in row]
        if r:
            k = min(5, len(r))
            print(f"reward/mean {r[0]:.3f} (step 1) -> {r[-1]:.3f} (step {len(r)}); mean of the first {k} steps "
                  f"{sum(r[:k]) / k:.3f}, of the last {k} {sum(r[-k:]) / k:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
