"""A tiny Qwen3-MoE GRPO run with the embedded engine, the megatron trainer and
``rollout.return_routed_experts: true``: the engine's routing travels with the batch, the trainer
replays it, and every step logs ``routing/replay_diff_frac``. The engine holds the trainer's weights
(float32, synced each step), so its routing is the trainer's own: the fraction is 0 up to router
near-ties (< 2% of choices covers a few float32 ties among a step's ~1000 choices)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "megatron"))

from mt_helpers import _shared  # noqa: E402
from run_helpers import lines  # noqa: E402
from test_routing_replay import make_moe  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_tiny_moe_run_replays_the_engine_routing(tmp_path):
    model = make_moe(str(tmp_path / "moe"), vocab=512)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
           "--master_port", str(_shared().free_port()), "launchers/grpo.py", "--config", "configs/demo_cpu.yaml",
           "--model.path", model, "--model.config", "", "--sft.max_steps", "0", "--max_steps", "2",
           "--rollout.batch_size", "2", "--grpo.n_samples", "2", "--rollout.max_new_tokens", "8",
           "--trainer.backend", "megatron", "--trainer.layer_spec", "torch", "--trainer.micro_batch_size", "2",
           "--rollout.return_routed_experts", "true", "--metrics.progress", "false", "--metrics.tensorboard", "false",
           "--output_dir", str(tmp_path), "--run_name", "r"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = lines(os.path.join(str(tmp_path), "r", "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["routing/replay_diff_frac"] < 0.02, r["routing/replay_diff_frac"]
        assert r["train_rollout_logprob_abs_diff"] < 1e-4


def test_dense_model_is_refused_with_a_config_error(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
           "--master_port", str(_shared().free_port()), "launchers/grpo.py", "--config", "configs/demo_cpu.yaml",
           "--sft.max_steps", "0", "--max_steps", "1", "--trainer.backend", "megatron",
           "--rollout.return_routed_experts", "true", "--output_dir", str(tmp_path), "--run_name", "d"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "megaforge: config error: config key 'rollout.return_routed_experts': the model" in p.stderr


def test_torch_backend_is_refused():
    from megaforge.config import config_from_dict
    from megaforge.configtree import ConfigError

    with pytest.raises(ConfigError, match="rollout.return_routed_experts.*trainer.backend megatron"):
        config_from_dict({"model": {"path": "x"}, "data": {"path": "y"}, "rollout": {"return_routed_experts": True}})


HANDOFF = r'''
import sys, torch
from megaforge import collective
from megaforge.data.batch import samples_to_batch, share_of
from megaforge.driver.handoff import BatchHandOff
from megaforge.types import Sample
collective.init_from_env("cpu", timeout_s=120)
g = torch.Generator().manual_seed(0)
samples = []
for i in range(4):
    n_p, n_r = 3 + i, 2 + 2 * i
    samples.append(Sample(prompt_ids=list(range(5, 5 + n_p)), response_ids=list(range(9, 9 + n_r)),
                          rollout_logprobs=[-1.0] * n_r, group_id=i // 2,
                          routed_experts=torch.randint(0, 4, (n_p + n_r - 1, 3, 2), generator=g, dtype=torch.int16)))
batch = samples_to_batch(samples, pad_id=0)
h = BatchHandOff(collective.rank(), collective.world(), 2)
got = h.share(batch if collective.is_main() else None)
want = share_of(batch, 2, collective.rank(), collective.world())
assert got.routed_experts.dtype == torch.int16 and torch.equal(got.routed_experts, want.routed_experts), collective.rank()
assert torch.equal(got.tokens, want.tokens)
print("handoff ok", collective.rank(), tuple(got.routed_experts.shape), flush=True)
'''


def test_handoff_carries_routed_experts_to_each_rank(tmp_path):
    """Two gloo ranks: rank 1 receives its share's [n, T, layers, topk] int16 routing from the main rank."""
    from mt_helpers import run_ranks

    codes, logs = run_ranks(["-c", HANDOFF], 2, tmp_path, "handoff", timeout=120)
    assert codes == [0, 0], logs
    assert all("handoff ok" in log for log in logs)
