"""Helpers of the planner tests: configs from recipe files with overrides, plans in-process, and
the launchers run as the user runs them (a subprocess), with the hub switched off."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODELS = os.path.join(ROOT, "configs", "models")
GSM8K = "configs/grpo_gsm8k_qwen3_1.7b.yaml"
GSPO = "configs/gspo_qwen3_30b_a3b.yaml"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def load(path: str, *overrides: str):
    from megaforge.config import load_config

    return load_config(["--config", os.path.join(ROOT, path), *overrides])


def plan(path: str, *overrides: str, mode: str = "grpo", **opts) -> dict:
    """make_plan of a recipe; ``opts`` are the dry-run flags (model_config defaults to the recipe's)."""
    from megaforge.build import RunBuilder
    from megaforge.planner import make_plan

    return make_plan(RunBuilder(load(path, *overrides)).plan_input(), mode, opts)


def header_lines(path: str) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            out.append(line[1:].strip())
    return out


def dry_run_commands(path: str) -> list[list[str]]:
    """The ``python launchers/... --dry_run ...`` commands written in a recipe's header."""
    return [shlex.split(ln) for ln in header_lines(path) if ln.startswith("python launchers/") and "--dry_run" in ln]


def run(argv: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    """``python <argv>`` from the repository root, offline."""
    env = dict(os.environ, **OFFLINE, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])
