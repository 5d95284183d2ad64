"""Every config in configs/ passes the dry run of its launcher, run as a user runs it (a subprocess,
hub switched off): the commands written in a recipe's header verbatim, and a plain ``--dry_run`` for
configs whose model config is local. A dry run creates no run directory."""
import glob
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from planner_helpers import ROOT, dry_run_commands, header_lines, last_json, load, run

from megaforge.planner import split_argv

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))
RECIPES = [c for c in CONFIGS if "hub" in next((ln for ln in header_lines(c) if ln.startswith("requires:")), "")]


def launcher_of(path: str) -> str:
    return "sft" if "launcher: sft" in header_lines(path) else "grpo"


def commands() -> list[tuple[str, list[str]]]:
    out = []
    for c in CONFIGS:
        cmds = dry_run_commands(c)
        if not cmds:  # a local model config: the plain dry run
            cmds = [["python", f"launchers/{launcher_of(c)}.py", "--config", os.path.relpath(c, ROOT), "--dry_run"]]
        out += [(os.path.relpath(c, ROOT), cmd) for cmd in cmds]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """All dry runs at once (two at a time: each is a fresh interpreter)."""
    out_dir = str(tmp_path_factory.mktemp("dry") / "runs")
    todo = commands()

    def one(item):
        path, cmd = item
        assert cmd[0] == "python"
        return item, run(cmd[1:] + ["--output_dir", out_dir])

    with ThreadPoolExecutor(2) as ex:
        res = list(ex.map(one, todo))
    return res, out_dir


def test_recipes_present():
    names = {os.path.basename(c) for c in RECIPES}
    assert {"grpo_gsm8k_qwen3_1.7b.yaml", "dapo_math_qwen2.5_7b.yaml", "gspo_qwen3_30b_a3b.yaml",
            "sft_llama3.1_8b.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.relpath(c, ROOT) for c in RECIPES])
def test_recipe_header_documents_hardware_slurm_and_dry_run(path):
    lines = header_lines(path)
    assert any(ln.startswith("Hardware:") for ln in lines)
    assert any(ln.startswith("Reproduces:") for ln in lines)
    slurm = [ln for ln in lines if ln.startswith("python launchers/slurm.py")]
    assert slurm and all(f"--config {os.path.relpath(path, ROOT)}" in ln for ln in slurm)
    for flag in ("--nodes", "--gpus_per_node", "--partition", "--account", "--time"):
        assert all(flag in ln for ln in slurm), flag
    cmds = dry_run_commands(path)
    assert cmds and all("--model_config" in c for c in cmds)
    assert all(c[1] == f"launchers/{launcher_of(path)}.py" for c in cmds)


def test_every_config_passes_its_dry_run(results):
    res, out_dir = results
    assert len(res) >= len(CONFIGS)
    for (path, cmd), proc in res:
        assert proc.returncode == 0, f"{path}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr
        plan = last_json(proc.stdout)
        assert plan["ok"] and plan["exit_code"] == 0 and not plan["errors"], path
        hw, lay = plan["hardware"], plan["layout"]
        assert f"--nodes {hw['nodes']}" in " ".join(cmd) or "--nodes" not in cmd
        # every GPU is listed once and every trainer rank sits on exactly one GPU
        gpus = [(r["node"], r["gpu"]) for r in plan["placement"]]
        assert len(gpus) == len(set(gpus)) == hw["nodes"] * hw["gpus_per_node"]
        ranks = sorted(r["trainer"]["rank"] for r in plan["placement"] if "trainer" in r)
        assert ranks == list(range(lay["world"]))
        assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == lay["world"]
        if lay["engine"] in ("sglang", "embedded_server"):
            eng = [r["engine"] for r in plan["placement"] if "engine" in r]
            assert len(eng) == lay["num_engines"] * lay["engine_tp"]
            assert sorted({e["id"] for e in eng}) == list(range(lay["num_engines"]))
        _, rest = split_argv(cmd[2:])  # the config arguments of the command (overrides included)
        cfg = load(path, *rest[2:])
        assert rest[:2] == ["--config", path]
        if cmd[1].endswith("sft.py"):
            assert set(plan["phases"]) == {"sft"}
        else:
            assert {"rollout", "train"} <= set(plan["phases"])
            assert ("sft" in plan["phases"]) == (cfg.sft.max_steps > 0)
        for name, ph in plan["phases"].items():
            assert ph["verdict"] in ("fits", "tight"), (path, name, ph)
            # items and the total are each rounded to 1e-3 GiB (Python floats): the sum of n items is
            # within n * 5e-4 of the total
            assert abs(sum(ph["items"].values()) - ph["allocated_gib"]) < 0.01 * max(1, len(ph["items"]))
    assert not os.path.exists(out_dir), "a dry run must not create the run directory"


def test_rl_recipes_fit_their_kv_cache(results):
    res, _ = results
    recipes = [os.path.relpath(r, ROOT) for r in RECIPES]
    for (path, cmd), proc in res:
        if path in recipes and cmd[1] == "launchers/grpo.py":
            plan = last_json(proc.stdout)
            assert plan["layout"]["engine"] == "sglang" and plan["layout"]["colocated"]
            assert plan["kv"]["capacity_tokens"] >= plan["kv"]["sequence_tokens"], path
            assert "placement" in proc.stdout and "verdict   OK" in proc.stdout
