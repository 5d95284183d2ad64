"""A real SGLang server serving the LoRA-adapted policy from the adapters alone (sync.lora_adapters with
rollout.engine sglang, megaforge.rollout.http.lora): the server started by ``build_engine`` with
``--enable-lora`` from model.lora, a torch trainer with rank-8 adapters on every linear of a tiny random
Qwen3 (bf16) on the same GPU. After each adapter sync the served log-probs equal the trainer's adapted
policy (not the base's), the previous adapter is gone from ``/v1/models``; the adapter syncs' bytes and
seconds are reported beside a merged sync's into the same server (sync.transport ipc). Figures go to ``$MEGAFORGE_GPU_REPORT_LORA``.
"""
from __future__ import annotations

import time

import pytest
import torch

from gpu_helpers import JsonReport, save_tiny_qwen3, serving, sglang_rollout
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(900)
PROMPTS = [[5, 17, 33, 9, 41], [100, 101, 102], [7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43]]
# bf16 serving vs the trainer's bf16 forward (test_sglang_server.py's LP_MAX_DIFF: a few 1e-3 measured
# on two layers); the adapter's x A^T B^T adds one more bf16 product per linear (SGLang's csgmv kernel
# vs PEFT's two matmuls), same order. Adapters perturbed by 0.3 randn move the log-probs by more than the tolerance (asserted).
LP_MAX_DIFF = 0.05
_report = JsonReport("MEGAFORGE_GPU_REPORT_LORA")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3-lora")))


@pytest.fixture(scope="module")
def cfg(model_dir, tmp_path_factory):
    from megaforge.config import config_from_dict

    return config_from_dict({
        "output_dir": str(tmp_path_factory.mktemp("run")), "run_name": "gpu_lora", "max_steps": 0, "seed": 0,
        "model": {"path": model_dir, "dtype": "bfloat16", "lora": {"rank": 8, "alpha": 16.0}},
        "data": {"path": "arithmetic", "format": "synthetic"},
        "rollout": sglang_rollout(),
        "sync": {"lora_adapters": True, "transport": "ipc"},
        "trainer": {"backend": "torch", "device": "cuda", "lr": 3e-3, "micro_batch_size": 8},
        "grpo": {"beta": 0.01},
    })


@pytest.fixture(scope="module")
def engine(cfg):
    yield from serving(cfg)


@pytest.fixture(scope="module")
def trainer(cfg):
    from megaforge.trainer.torch_backend import TorchTrainer

    t = TorchTrainer(RunBuilder(cfg).trainer_spec())
    t.reset_optimizer(cfg.trainer.lr, 10)
    t.snapshot_reference()  # fresh adapters: the reference is the base (adapters off)
    return t


def _perturb(trainer, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for _, p in trainer.lora.adapter_parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.3).to(p.device, p.dtype))


def _requests(seed=0):
    from megaforge.types import GenerateRequest, SamplingParams

    return [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=[], seed=seed + i),
                            rid=f"r{i}") for i, p in enumerate(PROMPTS)]


def _batch(comps):
    from megaforge.types import TrainBatch

    seqs = [p + c.output_ids for p, c in zip(PROMPTS, comps)]
    T = max(map(len, seqs))
    tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    mask = torch.zeros(tokens.shape)
    for b, (p, c) in enumerate(zip(PROMPTS, comps)):
        mask[b, len(p):len(p) + len(c.output_ids)] = 1.0
    return TrainBatch(tokens=tokens, lengths=torch.tensor([len(s) for s in seqs]), loss_mask=mask,
                      advantages=torch.zeros(tokens.shape), rollout_logprobs=torch.zeros(tokens.shape),
                      num_tokens=int(mask.sum()), num_seqs=len(seqs))


def _diff(lp, comps) -> float:
    d = torch.cat([(torch.tensor(c.output_logprobs) - lp[b, len(p):len(p) + len(c.output_ids)].float()).abs()
                   for b, (p, c) in enumerate(zip(PROMPTS, comps))])
    return float(d.max())


def _served_adapters(engine) -> set[str]:
    models = engine.query("GET", "/v1/models")[0]
    return {m["id"] for m in models.get("data", []) if m["id"].startswith("policy-v")}


def test_adapters_alone_serve_the_adapted_policy(engine, trainer):
    from megaforge.sync import push_weights
    from megaforge.sync.adapters import push_adapters

    for version, seed in ((1, 11), (2, 22)):
        _perturb(trainer, seed)
        t0 = time.perf_counter()
        stats = push_adapters(trainer, engine, 64 << 20, version)
        sync_s = time.perf_counter() - t0
        assert engine.adapter_name == f"policy-v{version}" and engine.weight_version == version
        assert _served_adapters(engine) == {f"policy-v{version}"}  # the previous one unloaded
        comps = engine.generate(_requests(seed=100 * version))
        assert all(c.weight_version == version for c in comps)
        batch = _batch(comps)
        adapted = _diff(trainer.compute_logprobs(batch), comps)
        base = _diff(trainer.compute_logprobs(batch, "ref"), comps)
        _report(f"v{version}", {"adapter_bytes": stats["bytes"], "adapter_sync_s": round(sync_s, 4),
                                "merged_bytes": push_weights(trainer, None, 64 << 20, version)["bytes"],
                                "max_lp_diff_adapted": adapted, "max_lp_diff_base": base})
        assert adapted < LP_MAX_DIFF < base
    # the merged sync of the same adapters into the same server (its base weights become W + s B A), timed
    # in the same run for the comparison; nothing is generated after it (the adapter would then apply twice)
    t0 = time.perf_counter()
    merged = push_weights(trainer, engine, 64 << 20, 3)
    _report("merged_sync", {"bytes": merged["bytes"], "sync_s": round(time.perf_counter() - t0, 4)})
    assert engine.weight_version == 3
