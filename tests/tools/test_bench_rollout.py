"""tools/bench/bench_rollout.py --sglang starts the server a run starts (tools/bench/sglang_server_bench.py):
for the same settings, the command line and environment of megaforge.rollout.http.sglang
(embedded_server for the CPU stand-in, ``--sglang_server embedded``), built from a run's YAML config
here."""
import os
import sys

import pytest
import torch
import yaml

from megaforge.build import RunBuilder
from megaforge.config import load_config
from megaforge.rollout.http import embedded_server, sglang
from megaforge.rollout.http.start import ServerStart
from megaforge.supervise import env_from_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
import bench_rollout  # noqa: E402
import sglang_server_bench  # noqa: E402

KIT_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--cuda-graph-backend-prefill", "disabled"]


def run_config(tmp_path, tree: dict):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return RunBuilder(load_config(["--config", str(path)])).engine_spec()  # what a run gives its engine kind


def test_sglang_server_is_the_one_a_run_starts(tmp_path):
    env_sh = tmp_path / "env.sh"
    env_sh.write_text("export MEGAFORGE_TEST_SGL_HOME=/opt/sgl\nexport LD_LIBRARY_PATH=/opt/sgl/lib\n")
    args, _, _, _ = bench_rollout.parse_args(["--sglang", "--device", "cuda", "--sglang_python", "/opt/sgl/bin/python",
                                              "--sglang_env_sh", str(env_sh), "--sglang_mem", "0.4"])
    servers, cfg, start = sglang_server_bench.server_launch("/models/shape", args)
    run = run_config(tmp_path, {"data": {"path": "/data/train.jsonl"}, "model": {"path": "/models/shape", "dtype": "bfloat16"}, "rollout": {
        "engine": "sglang", "engine_python": "/opt/sgl/bin/python", "mem_fraction": 0.4, "extra_args": KIT_FLAGS,
        "engine_env": env_from_script(str(env_sh))}})  # what the kit's env.sh sets, as the bench's --sglang_env_sh
    run_start = ServerStart("/models/shape", "", "", [], torch.device("cuda"))
    cmd = servers.command(cfg, start, 30123, None)
    assert cmd == sglang.command(run, run_start, 30123, None)
    assert servers.env(cfg, start) == sglang.env(run, run_start)
    assert servers.hold_socket is sglang.SERVERS.hold_socket is False
    # what the bench relies on: its interpreter, dtype, seed and memory share, the memory saver (it
    # releases SGLang's memory before the fast engine runs) and the kit's flags last
    assert cmd[:3] == ["/opt/sgl/bin/python", "-m", "sglang.launch_server"] and cmd[-len(KIT_FLAGS):] == KIT_FLAGS
    pairs = dict(zip(cmd[3:], cmd[4:]))
    assert pairs["--model-path"] == "/models/shape" and pairs["--dtype"] == "bfloat16"
    assert pairs["--mem-fraction-static"] == "0.4" and pairs["--random-seed"] == "0" and pairs["--port"] == "30123"
    assert "--enable-memory-saver" in cmd and "--api-key" not in cmd
    env = servers.env(cfg, start)
    assert env["MEGAFORGE_TEST_SGL_HOME"] == "/opt/sgl" and env["LD_LIBRARY_PATH"] == "/opt/sgl/lib"


def test_embedded_stand_in_is_the_embedded_server_a_run_starts(tmp_path):
    args, _, _, _ = bench_rollout.parse_args(["--sglang", "--sglang_server", "embedded", "--tiny", "--device", "cpu"])
    servers, cfg, start = sglang_server_bench.server_launch("/models/tiny", args)
    run = run_config(tmp_path, {"data": {"path": "/data/train.jsonl"}, "model": {"path": "/models/tiny", "dtype": "float32"}, "rollout": {
        "engine": "embedded_server", "device": "cpu", "engine_batch_size": 4096}})
    run_start = ServerStart("/models/tiny", "", "", [], torch.device("cpu"))
    cmd = servers.command(cfg, start, 30124, 9)
    assert cmd == embedded_server.command(run, run_start, 30124, 9)
    assert servers.env(cfg, start) == embedded_server.env(run, run_start)
    assert servers.hold_socket is True and cmd[cmd.index("--sock-fd") + 1] == "9"
    assert cmd[cmd.index("--max-batch") + 1] == "4096" and "--attention-backend" not in cmd  # SGLang's flags stay SGLang's


def test_sglang_attention_backends_each_get_a_server_with_that_backend_only(tmp_path):
    # issue 38 point 4: FA3 (SGLang's Hopper default) beside triton in one run, one server each
    args, _, _, _ = bench_rollout.parse_args(["--sglang", "--device", "cuda", "--sglang_attention", "fa3,triton"])
    assert args.sglang_attention == ["fa3", "triton"]
    for attn in args.sglang_attention:
        servers, cfg, start = sglang_server_bench.server_launch("/models/shape", args, attn)
        cmd = servers.command(cfg, start, 30125, None)
        assert cmd.count("--attention-backend") == 1 and cmd[cmd.index("--attention-backend") + 1] == attn
        assert cmd[cmd.index("--sampling-backend") + 1] == "pytorch"  # the kit's other flags kept
        assert "--cuda-graph-backend-prefill" in cmd
    assert sglang_server_bench.with_attention("--attention-backend=triton --x 1", "fa3") == ["--x", "1", "--attention-backend", "fa3"]
    assert sglang_server_bench.with_attention("--x 1", None) == ["--x", "1"]


@pytest.mark.parametrize("argv", [["--sglang", "--sglang_server", "embedded", "--tiny", "--sglang_attention", "fa3"],
                                  ["--sglang_attention", "fa3"], ["--sglang", "--sglang_attention", "fa3,fa3"]])
def test_sglang_attention_is_refused_where_no_sglang_server_runs_or_twice(argv, capsys):
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(argv)
    assert "--sglang_attention" in capsys.readouterr().err
