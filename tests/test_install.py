"""Install and first run (issue 41, point 8): the requirements files parse; requirements-dev.txt holds every
third-party package that the tests, the tools they load, the examples and megaforge import (GPU-only
ones: requirements-gpu.txt, the pins that ran on the H200); requirements.txt holds the demo's needs
and no test-only package; CI installs the dev file; the README's first command is one line that runs
the demo in one process (no torchrun), which ends with a summary line (folder, first -> last, the
plot command)."""
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest

from megaforge.metrics import run_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: import name -> distribution, where they differ and the distribution may not be installed here
DIST = {"yaml": "pyyaml", "megatron": "megatron-core", "math_verify": "math-verify", "transformer_engine":
        "transformer-engine", "torch_memory_saver": "torch-memory-saver", "huggingface_hub": "huggingface-hub",
        "sglang": "sglang", "sklearn": "scikit-learn", "PIL": "pillow", "hydra": "hydra-core"}
#: packages only a GPU machine has (imported where a GPU config asks for them): requirements-gpu.txt
GPU_ONLY = {"transformer-engine", "torch-memory-saver", "sglang"}
#: installed as a dependency of a listed package (named here so that the test says why it passes)
COMES_WITH = {"huggingface-hub": "transformers", "sympy": "torch"}
#: imports that are no distribution: a CUDA extension module built with apex / megatron, a module a test
#: writes into its tmp_path
NOT_PACKAGES = {"fused_weight_gradient_mlp_cuda", "my_plugins", "typed_adv"}
#: the peers' own environments (tools/peers/, issue 39): pinned in tools/peers/wheels_<peer>.txt, not megaforge's
PEER_FILES = ("tools/peers/wheels_trl.txt", "tools/peers/wheels_verl.txt", "tools/peers/wheels_fa2.txt",
              "tools/peers/wheels_vllm.txt", "tools/peers/wheels_slime.txt")
TEST_ONLY = {"pytest", "pytest-timeout", "openai", "megatron-core", "gguf", "accelerate", "datasets", "pyarrow",
             "wandb", "submitit"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(name: str) -> dict[str, str]:
    """{distribution: specifier} of a requirements file, following ``-r`` includes."""
    out: dict[str, str] = {}
    with open(os.path.join(ROOT, name)) as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("-r "):
                out.update(requirements(line[3:].strip()))
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*((?:[=<>!~]=?[^,;\s]+,?)*)", line)
            assert m, f"{name}: {raw!r} is not a requirement line"
            out[norm(m.group(1))] = m.group(3)
    return out


def local_names() -> set[str]:
    names = {"megaforge", "tests", "tools", "examples", "launchers"}
    for top in ("megaforge", "tests", "tools", "examples", "launchers"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            names.update(f[:-3] for f in files if f.endswith(".py"))
            names.update(dirs)
    return names - {"megatron"}  # megaforge/trainer/megatron is a package of megaforge; megatron. imports are megatron-core


def third_party_imports(*tops: str) -> dict[str, str]:
    """{distribution: a file importing it} of every import (module level or inside a function, and
    ``pytest.importorskip("x")``) under the given folders that is neither stdlib nor local."""
    pkgs = importlib.metadata.packages_distributions()
    local, std = local_names(), set(sys.stdlib_module_names)
    found: dict[str, str] = {}
    for top in tops:
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                with open(path) as fh:
                    tree = ast.parse(fh.read())
                for n in ast.walk(tree):
                    mods = []
                    if isinstance(n, ast.Import):
                        mods = [a.name for a in n.names]
                    elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                        mods = [n.module]
                    elif (isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "importorskip" and n.args
                          and isinstance(n.args[0], ast.Constant)):
                        mods = [n.args[0].value]
                    for m in mods:
                        t = m.split(".")[0]
                        if t in std or t in local or t == "megaforge" or t in NOT_PACKAGES:
                            continue
                        dist = DIST.get(t) or (pkgs.get(t) or [t])[0]
                        found.setdefault(norm(dist), os.path.relpath(path, ROOT))
    return found


def test_the_requirements_files_parse_and_pin_the_h200_versions():
    demo, dev, gpu = requirements("requirements.txt"), requirements("requirements-dev.txt"), requirements("requirements-gpu.txt")
    assert set(demo) < set(dev) and demo["torch"] == "==2.13.0"
    for name, version in (("torch", "2.11.0"), ("sglang", "0.5.16"), ("transformer-engine", "2.20.2"),
                          ("megatron-core", "0.16.1")):
        assert gpu[name] == f"=={version}", name
    assert all(spec.startswith("==") for spec in gpu.values()), gpu  # pins, for pip -c


def peer_pins() -> set[str]:
    """Distributions pinned in the peers' wheel lists (``name==version`` lines)."""
    out = set()
    for name in PEER_FILES:
        with open(os.path.join(ROOT, name)) as f:
            out |= {norm(line.split("==")[0].strip()) for line in f if "==" in line.split("#", 1)[0]}
    return out


def test_dev_requirements_cover_every_third_party_import():
    dev, gpu = requirements("requirements-dev.txt"), requirements("requirements-gpu.txt")
    found = third_party_imports("tests", "tools", "examples", "megaforge")
    assert "pytest" in found and "megatron-core" in found and "openai" in found  # the scan sees them
    peers = {d for d, f in found.items() if f.startswith(("tools/peers/", "tests/tools/test_peers_"))}
    assert {"trl", "verl", "ray", "vllm", "slime"} <= peers  # the scan sees the peers' imports too
    unpinned = {d: found[d] for d in peers if d not in dev and d not in peer_pins()}
    assert not unpinned, f"a peer's import pinned neither in requirements-dev.txt nor in {PEER_FILES}: {unpinned}"
    missing = {d: f for d, f in found.items() if d not in peers
               and d not in dev and not (d in GPU_ONLY and d in gpu) and COMES_WITH.get(d) not in dev}
    assert not missing, f"imported but in no requirements file: {missing}"


def test_the_demo_requirements_hold_no_test_only_package():
    demo = requirements("requirements.txt")
    assert not TEST_ONLY & set(demo), TEST_ONLY & set(demo)
    for need in ("torch", "transformers", "math-verify", "tensorboard", "matplotlib", "pyyaml"):
        assert need in demo, need


def test_ci_installs_the_dev_requirements():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "pip install -q -r requirements-dev.txt -e ." in f.read()


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_the_readme_first_command_is_one_line_without_torchrun():
    first = re.search(r"```bash\n(.*?)\n```", readme(), re.S).group(1)
    assert first == "pip install -r requirements.txt -e . && python launchers/grpo.py --config configs/demo_cpu.yaml"
    text = readme()
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "requirements-gpu.txt" in text.split("## Moving to GPUs", 1)[1]


def test_run_summary_names_folder_first_last_and_the_plot_command(tmp_path):
    (tmp_path / "sft_metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": l}) + "\n"
                                                        for s, l in ((1, 6.25), (2, 3.0), (3, 0.5))))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/x/greedy/pass@1": 0.1}) + "\n" + "".join(
        json.dumps({"step": s, "reward/mean": r}) + "\n" for s, r in ((1, 0.3), (2, 0.5), (3, 0.875))))
    assert run_summary(str(tmp_path)) == (f"megaforge: done: {tmp_path}; SFT loss 6.25 -> 0.5 (SFT steps 1-3); "
                                          f"reward/mean 0.3 -> 0.875 (RL steps 1-3); curves: python tools/plot_run.py "
                                          f"{tmp_path}")
    os.remove(tmp_path / "sft_metrics.jsonl")
    assert run_summary(str(tmp_path)).count(" -> ") == 1


def test_one_process_demo_run_ends_with_the_summary_and_errors_in_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env = {k: v for k, v in env.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    cmd = [sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), "--config", "configs/demo_cpu.yaml",
           "--sft.max_steps", "2", "--max_steps", "1", "--rollout.batch_size", "2", "--grpo.n_samples", "2",
           "--rollout.max_new_tokens", "4", "--metrics.progress", "false", "--metrics.tensorboard", "false",
           "--output_dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    last = p.stdout.strip().splitlines()[-1]
    run = os.path.join(str(tmp_path), "demo_cpu")
    assert last.startswith(f"megaforge: done: {run}; SFT loss ") and " reward/mean 0 -> 0 (RL steps 1-1)" in last
    assert last.endswith(f"curves: python tools/plot_run.py {run}")
    p = subprocess.run(cmd + ["--grpo.n_sample", "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("megaforge: config error: ")


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-dev.txt", "requirements-gpu.txt"])
def test_every_requirement_line_names_a_version_or_a_floor(name):
    assert all(spec for spec in requirements(name).values()), name
