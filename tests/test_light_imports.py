"""Modules that light processes import start without torch: megaforge.config (everything reads it; the
reward workers within their start-up deadline), the reward workers' modules, the launcher before
--help / --dry_run answer, the planner, the SLURM submission (a login node) and the engine server
processes' helpers. Each is imported in a fresh interpreter, which reports what it loaded."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "transformers", "megaforge.algorithms")
PROBE = ("import importlib, sys\n"
         "importlib.import_module(sys.argv[1])\n"
         "print(' '.join(m for m in sys.argv[2:] if m in sys.modules))\n")


def loaded_heavy(module: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PROBE, module, *HEAVY], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("module", ["megaforge", "megaforge.api", "megaforge.config", "megaforge.rewards", "megaforge.rewards.executor",
                                    "megaforge.launch", "megaforge.planner", "megaforge.slurm",
                                    "megaforge.rollout.http.processes", "megaforge.supervise"])
def test_a_light_module_imports_no_torch(module):
    assert loaded_heavy(module) == []


def test_the_probe_sees_torch_where_a_module_imports_it():
    assert "torch" in loaded_heavy("megaforge.types")  # types holds tensors: the probe can fail
