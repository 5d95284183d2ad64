"""Issue 42 point 3: rollout engine kinds are registry entries (megaforge.engine_kinds); a new kind is
one module plus one registration (tests/rollout/toy_engine_kind.py), which the config, the preflight,
the planner's placement and a whole CPU run then use; an unknown kind is one config error naming
``rollout.engine`` and the nearest kind."""
import os

import pytest

from megaforge.config import Config, load_config
from megaforge.configtree import ConfigError
from megaforge.engine_kinds import ENGINE_KINDS, engine_kind
from tests.run_helpers import run_in_process
from megaforge.build import RunBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = ["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml")]
TOY = ["--algo.plugins", "[toy_engine_kind]", "--rollout.engine", "toy"]
SHORT = ["--sft.max_steps", "0", "--rollout.batch_size", "2", "--grpo.n_samples", "2", "--rollout.max_new_tokens", "4",
         "--max_steps", "1", "--metrics.progress", "false", "--metrics.tensorboard", "false"]


def test_an_unknown_engine_kind_is_one_config_error_with_the_nearest_kind():
    rc, out, err = run_in_process("grpo", [*DEMO, "--dry_run", "--rollout.engine", "sglnag"])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("megaforge: config error: config key 'rollout.engine': expected one of 'embedded', "
                               "'embedded_server', 'sglang'")
    assert lines[0].endswith("got 'sglnag'; did you mean 'sglang'?")
    cfg = Config()
    cfg.rollout.engine = "embeded"  # set in code, past the config's check: the lookup says the same
    from megaforge.rollout import build_engine

    with pytest.raises(ConfigError, match="config key 'rollout.engine': .*did you mean 'embedded'"):
        build_engine(RunBuilder(cfg).engine_spec(), None)


def test_the_toy_kind_is_accepted_checked_and_placed_like_a_built_in_one():
    cfg = load_config([*DEMO, *TOY])  # algo.plugins imports the module, which registers the kind
    assert "toy" in ENGINE_KINDS and engine_kind("toy").in_process
    import toy_engine_kind

    # the config's checks read the kind's facts: in-process, so weights are handed over in memory
    with pytest.raises(ConfigError, match="sync.transport.*rollout.engine 'toy' takes the trainer's weights"):
        load_config([*DEMO, *TOY, "--sync.transport", "shm"])
    with pytest.raises(ConfigError, match="loop.mode off_policy"):
        load_config([*DEMO, *TOY, "--loop.mode", "off_policy"])
    # its preflight runs with the others
    from megaforge.build import RunBuilder

    RunBuilder(cfg).preflight()
    cfg.rollout.top_k = 5
    with pytest.raises(ConfigError, match="config key 'rollout.top_k': the toy engine"):
        RunBuilder(cfg).preflight()
    # the planner places it where in-process engines live: rank 0's process, GPU 0 of node 0
    from megaforge.planner import make_plan

    p = make_plan(RunBuilder(load_config([*DEMO, *TOY, "--rollout.num_gpus", "1"])).plan_input(), "grpo", dict(gpus_per_node=2))
    assert p["layout"]["engine"] == "toy" and p["layout"]["rollout_gpus"] == 0, p["errors"]
    assert [r["engine"] for r in p["placement"] if "engine" in r] == [{"id": 0, "tp_rank": 0, "in_process": True}]
    assert any("ignored by the toy engine" in w for w in p["warnings"])
    assert toy_engine_kind.COUNTS["built"] == 0  # nothing was built so far


def test_a_cpu_run_generates_through_the_toy_kind(tmp_path):
    import toy_engine_kind

    before = dict(toy_engine_kind.COUNTS)
    rc, out, err = run_in_process("grpo", [*DEMO, *TOY, *SHORT, "--output_dir", str(tmp_path), "--run_name", "toy"])
    assert rc == 0, err[-3000:]
    assert toy_engine_kind.COUNTS["built"] == before["built"] + 1
    assert toy_engine_kind.COUNTS["generated"] - before["generated"] >= 2 * 2  # the step's prompts x samples
    assert os.path.exists(tmp_path / "toy" / "metrics.jsonl")
    # the preflight stops a run at start-up, before its run directory
    rc, out, err = run_in_process("grpo", [*DEMO, *TOY, *SHORT, "--rollout.top_k", "5", "--output_dir", str(tmp_path),
                                           "--run_name", "refused"])
    assert rc == 1 and err.strip().startswith("megaforge: config error: config key 'rollout.top_k'"), err
    assert not os.path.exists(tmp_path / "refused")


def test_a_plugin_kind_is_accepted_whatever_the_order_of_the_config_sections(tmp_path, monkeypatch):
    # rollout before algo in the tree: the kind is checked once the whole tree (and algo.plugins) is read
    (tmp_path / "toy_kind_42b.py").write_text(
        "from megaforge.engine_kinds import ENGINE_KINDS, EngineKind\n"
        "ENGINE_KINDS.register('toy_42b', EngineKind(build='toy_engine_kind:build', in_process=True))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from megaforge.config import config_from_dict

    tree = {"rollout": {"engine": "toy_42b"}, "algo": {"plugins": ["toy_kind_42b"]}, "model": {"path": "m"},
            "data": {"path": "d"}}
    assert config_from_dict(tree).rollout.engine == "toy_42b"
    with pytest.raises(ConfigError, match="'rollout.engine': expected one of .*got 'toy_42c'; did you mean 'toy_42b'"):
        config_from_dict({**tree, "rollout": {"engine": "toy_42c"}})


def test_two_nodes_start_a_kind_through_its_build_on_each_node_leader(tmp_path):
    # 2 nodes x (1 trainer rank + 1 rollout GPU): the planner's placement puts engine k on node k; each
    # node leader calls the kind's build with its share, rank 0 gets every engine's URL in id order
    import json
    import subprocess
    import sys

    from megaforge.net import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_kind_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(tmp_path / f"rank{r}.json")], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["engine"] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"] and r1["engine"] is None
    assert r0["calls"] == [{"key": "key-of-rank-0", "engine_ids": [0], "gpus": [[1]]}]
    assert r1["calls"] == [{"key": "key-of-rank-0", "engine_ids": [1], "gpus": [[1]]}]  # rank 0's API key
    assert r1["stopped"] == [True]  # node 1's servers stop with the run; rank 0's belong to its engine
