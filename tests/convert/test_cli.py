"""The conversion CLIs as users run them (no torchrun: the tools spawn their own gloo ranks)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from cv_helpers import ROOT, hf_state, load_hf_checked

TOOLS = os.path.join(ROOT, "tools")


def _run(tool, *args, timeout=300):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(TOOLS, tool), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def ckpt(tiny_hf, tmp_path_factory):
    """Qwen3 (tied, bf16, vocabulary 300) converted at TP=2 by the CLI (2 spawned ranks)."""
    out = tmp_path_factory.mktemp("cli") / "ckpt"
    p = _run("convert_hf_to_megatron.py", "--hf", tiny_hf["qwen3_tied"], "--out", out, "--tp", 2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"wrote {out}" in p.stdout
    meta = json.load(open(out / "megaforge_trainer.json"))
    assert meta["layout"]["tensor_parallel"] == 2 and meta["sched"] is None and meta["dtype"] == "bfloat16"
    return out


def test_cli_back_to_hf_at_another_layout_with_shards(ckpt, tiny_hf, tmp_path):
    """Saved at TP=2 (vocabulary padded to 512), exported by one rank at TP=1 (384): bit-identical
    bf16 tensors, sharded with an index, loads in transformers without key warnings."""
    out = tmp_path / "hf"
    p = _run("convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", out, "--tp", 1, "--max-shard-size", "40KB")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got, want = hf_state(str(out)), hf_state(tiny_hf["qwen3_tied"])
    assert set(got) == set(want) and all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
    assert os.path.exists(out / "model.safetensors.index.json")
    load_hf_checked(str(out), dtype=torch.bfloat16)
    p = _run("convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", out, "--tp", 1)
    assert p.returncode == 2 and "not empty" in p.stderr


def test_cli_missing_shard_fails_naming_it_and_leaves_nothing(ckpt, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    os.remove(broken / "__1_0.distcp")
    out = tmp_path / "hf"
    p = _run("convert_megatron_to_hf.py", "--ckpt", broken, "--out", out, "--tp", 1)
    assert p.returncode != 0
    assert "missing shard file" in p.stderr and "__1_0.distcp" in p.stderr, p.stderr[-3000:]
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".hf.")]


@pytest.mark.slow  # ~12 s; a benchmark (run on the H200: docs/benchmarks); the conversions: tests/convert
def test_bench_convert_tiny_reports_one_json_line(tmp_path):
    """tools/bench/bench_convert.py --tiny (CPU, Qwen3-MoE, 50 kB buckets) streams the whole model."""
    p = _run(os.path.join("bench", "bench_convert.py"), "--tiny")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, p.stdout[-2000:]
    rep = json.loads(lines[0])
    # float32 HF bytes = 4 x the Megatron parameters less the 2 x 3 padded vocabulary rows (509 -> 512)
    assert rep["family"] == "qwen3_moe" and rep["hf_bytes"] == 4 * (rep["params_rank0"] - 2 * 3 * 64)
    assert rep["buckets"] > 5
    assert rep["iter_gbps"] > 0 and rep["copy_gbps"] > 0
