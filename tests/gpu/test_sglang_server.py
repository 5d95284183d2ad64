"""The real SGLang server behind megaforge's HTTP engine: every endpoint megaforge uses.

One server (a tiny random Qwen3, bf16, head_dim 128, the repo tokenizer) is launched by
``build_engine`` (``rollout.engine: sglang``, its own environment through ``rollout.engine_env``) on
this machine's GPU, beside a torch trainer holding the same weights on the same GPU. Covered:
release and abilities, batched ``/generate`` with ``input_ids`` and ``n`` > 1, served logprobs equal
to the trainer's on the same weights (bf16), ``/update_weights_from_tensor`` (flattened buckets by
CUDA IPC and by CPU shared memory) and ``/update_weights_from_disk`` after which the served logprobs
follow the trainer's, ``sync.check_equal`` through ``/weights_checker``, weight versions,
release/resume by tag with the device memory really freed, pause/continue, abort,
``/health_generate``, and a server killed by SIGKILL mid-rollout: restarted, re-synced, every prompt
answered once. Figures go to ``$MEGAFORGE_GPU_REPORT`` (a JSON file) when it is set.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from gpu_helpers import JsonReport, save_tiny_qwen3, serving, sglang_rollout, sglang_version
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(1500)
PROMPTS = [[5, 17, 33, 9, 41], [100, 101, 102], [7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43],
           [300, 301], [9, 9, 9, 9, 9, 9], [250, 12, 77], [60, 61, 62, 63, 64]]
# bf16 forward of a 2-layer model, SGLang (Triton attention) vs the trainer (torch SDPA): logits carry
# ~2^-8 relative rounding per op; over two layers a token's logprob moves by a few 1e-3 (measured
# 0.002-0.004 on the prompt logprobs of such models). A training step at this LR moves them by ~0.1.
LP_MAX_DIFF = 0.05
_report = JsonReport("MEGAFORGE_GPU_REPORT")


def _cfg(tmp, model_dir, **rollout):
    from megaforge.config import config_from_dict

    return config_from_dict({
        "output_dir": str(tmp), "run_name": "gpu", "max_steps": 0, "seed": 0,
        "model": {"path": model_dir, "dtype": "bfloat16"},
        "data": {"path": "arithmetic", "format": "synthetic"},
        "rollout": sglang_rollout(max_restarts=1, health_timeout_s=120.0, **rollout),
        "sync": {"transport": "ipc"},
        "trainer": {"backend": "torch", "device": "cuda", "lr": 3e-3, "micro_batch_size": 8, "grad_clip": 1.0},
        "grpo": {"beta": 0.0},
    })


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="module")
def cfg(model_dir, tmp_path_factory):
    return _cfg(tmp_path_factory.mktemp("run"), model_dir)


@pytest.fixture(scope="module")
def engine(cfg):
    yield from serving(cfg, _report, "server_start_s")


@pytest.fixture(scope="module")
def trainer(cfg):
    from megaforge.trainer.torch_backend import TorchTrainer

    return TorchTrainer(RunBuilder(cfg).trainer_spec())


def _requests(max_new=16, seed=0, prompts=PROMPTS):
    from megaforge.types import GenerateRequest, SamplingParams

    return [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=[], seed=seed + i),
                            rid=f"r{i}") for i, p in enumerate(prompts)]


def _batch(prompts, comps):
    from megaforge.types import TrainBatch

    seqs = [p + c.output_ids for p, c in zip(prompts, comps)]
    T = max(map(len, seqs))
    tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
    lengths = torch.tensor([len(s) for s in seqs])
    mask = torch.zeros(tokens.shape)
    for b, (p, c) in enumerate(zip(prompts, comps)):
        mask[b, len(p):len(p) + len(c.output_ids)] = 1.0
    g = torch.Generator().manual_seed(len(seqs))
    adv = torch.randn(len(seqs), generator=g)[:, None] * mask
    rlp = torch.zeros(tokens.shape)
    for b, (p, c) in enumerate(zip(prompts, comps)):
        rlp[b, len(p):len(p) + len(c.output_ids)] = torch.tensor(c.output_logprobs)
    return TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=adv, rollout_logprobs=rlp,
                      num_tokens=int(mask.sum()), num_seqs=len(seqs))


def _lp_diff(trainer, comps, prompts=PROMPTS) -> tuple[float, float]:
    """(mean, max) |served logprob - trainer logprob| over every generated token."""
    lp = trainer.compute_logprobs(_batch(prompts, comps))
    d = torch.cat([(torch.tensor(c.output_logprobs) - lp[b, len(p):len(p) + len(c.output_ids)]).abs()
                   for b, (p, c) in enumerate(zip(prompts, comps))])
    return float(d.mean()), float(d.max())


def _train(trainer, engine, steps=2):
    """Move the trainer's weights (a few updates on served samples) so the engine's go stale."""
    for k in range(steps):
        comps = engine.generate(_requests(seed=100 + k))
        trainer.train_step(_batch(PROMPTS, comps))


def test_release_and_abilities(engine):
    caps = engine.caps[0]
    assert caps.frontend == "sglang" and caps.version == sglang_version()
    assert caps.weight_update_session is (tuple(map(int, caps.version.split(".")[:3])) >= (0, 5, 21))
    info = engine._call(engine.clients[0].get_server_info())
    _report("server", {"version": info["version"], "dtype": info.get("dtype"), "tp_size": info.get("tp_size"),
                       "max_total_num_tokens": info.get("max_total_num_tokens")})
    assert engine.weight_version == 0


def test_generate_batch_n_and_logprobs_equal_the_trainers(engine, trainer):
    from megaforge.rollout.http.protocol import completion_from_output
    from megaforge.sync import push_weights

    stats = push_weights(trainer, engine, 64 << 20, 1)  # CUDA IPC: the trainer's own tensors
    comps = engine.generate(_requests())
    assert [c.rid for c in comps] == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(c.weight_version == 1 and 0 < len(c.output_ids) <= 16 for c in comps)
    mean, worst = _lp_diff(trainer, comps)
    _report("logprobs_vs_trainer_same_weights", {"mean_abs": mean, "max_abs": worst, "sync": stats})
    assert worst <= LP_MAX_DIFF, f"served logprobs differ from the trainer's by up to {worst:.4f}"
    c = engine.clients[0]
    outs = engine._call(c.generate({"input_ids": PROMPTS[0], "return_logprob": True,
                                    "sampling_params": {"n": 4, "temperature": 1.0, "max_new_tokens": 8}}))
    assert isinstance(outs, list) and len(outs) == 4
    parsed = [completion_from_output(o, "/generate") for o in outs]
    assert all(len(p.output_ids) == len(p.output_logprobs) > 0 for p in parsed)


def test_tensor_updates_by_ipc_and_shm_make_the_served_logprobs_follow(engine, trainer):
    from megaforge.rollout.http.engine import HTTPEngine
    from megaforge.sync import push_weights

    _train(trainer, engine)
    stale = _lp_diff(trainer, engine.generate(_requests(seed=7)))  # engine on the old weights
    t = time.perf_counter()
    push_weights(trainer, engine, 64 << 20, 2)
    ipc_s = time.perf_counter() - t
    ipc = _lp_diff(trainer, engine.generate(_requests(seed=7)))
    assert ipc[1] <= LP_MAX_DIFF < stale[1], (ipc, stale)  # the negative control: old weights are far off
    _train(trainer, engine)
    shm = HTTPEngine([c.url for c in engine.clients], transport="shm", model_dir=engine.model_dir)
    try:
        push_weights(trainer, shm, 64 << 20, 3)
        comps = engine.generate(_requests(seed=8))
        assert {c.weight_version for c in comps} == {3}
        got = _lp_diff(trainer, comps)
        assert got[1] <= LP_MAX_DIFF, got
    finally:
        shm.shutdown()  # its clients only: the server belongs to `engine`
    _report("tensor_updates", {"stale_weights_max_abs": stale[1], "ipc_max_abs": ipc[1], "ipc_update_s": ipc_s,
                               "shm_max_abs": got[1]})


def test_update_from_disk(engine, trainer):
    from megaforge.rollout.http.engine import HTTPEngine
    from megaforge.sync import push_weights

    _train(trainer, engine)
    disk = HTTPEngine([c.url for c in engine.clients], transport="disk", model_dir=engine.model_dir)
    try:
        push_weights(trainer, disk, 64 << 20, 4)
    finally:
        disk.shutdown()
    comps = engine.generate(_requests(seed=9))
    assert {c.weight_version for c in comps} == {4}
    got = _lp_diff(trainer, comps)
    _report("disk_update_max_abs", got[1])
    assert got[1] <= LP_MAX_DIFF, got


def test_check_equal_through_weights_checker(engine, trainer):
    from megaforge.sync import WeightMismatchError, check_engine_weights, push_weights

    stats = push_weights(trainer, engine, 64 << 20, 5, check_equal=True)
    assert stats["checked"] > 0
    name, t = next((n, t) for bk in trainer.iter_hf_buckets(1 << 30) for n, t in bk if n.endswith("1.mlp.up_proj.weight"))
    bad = t.detach().clone()
    bad[-1, -1] += 1.0
    engine.update_weights([[(name, bad)]], 5)  # one engine tensor differs from the trainer's now
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        check_engine_weights(trainer, engine)
    assert push_weights(trainer, engine, 64 << 20, 6, check_equal=True)["checked"] == stats["checked"]
    _report("check_equal_tensors", stats["checked"])


def test_weight_version_is_served(engine):
    c = engine.clients[0]
    assert engine.weight_version == 6
    assert engine._call(c.get_model_info())["weight_version"] == "6"
    engine._call(c.update_weight_version("60"))  # a version without a weight change
    assert engine.weight_version == 60 and all(x.weight_version == 60 for x in engine.generate(_requests(max_new=2)))
    engine._call(c.update_weight_version("6"))


def test_release_and_resume_by_tag_free_the_memory(engine, trainer):
    from megaforge.rollout.base import EngineStateError
    from megaforge.sync import push_weights

    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    engine.release_memory(["kv_cache"])
    free_kv = torch.cuda.mem_get_info()[0]
    engine.release_memory(["weights"])
    free_all = torch.cuda.mem_get_info()[0]
    with pytest.raises(EngineStateError):
        engine.generate(_requests(max_new=2))
    engine.resume_memory(["weights"])
    push_weights(trainer, engine, 64 << 20, 7)  # SGLang keeps no copy of released weights: sent again
    engine.resume_memory(["kv_cache"])
    free_back = torch.cuda.mem_get_info()[0]
    comps = engine.generate(_requests(seed=10))
    got = _lp_diff(trainer, comps)
    gib = 1 << 30
    _report("release_resume", {"freed_kv_cache_gib": (free_kv - free0) / gib, "freed_weights_gib": (free_all - free_kv) / gib,
                               "taken_back_gib": (free_all - free_back) / gib, "max_abs_after": got[1]})
    assert free_kv - free0 > 5 * gib, "releasing the KV cache freed less than 5 GiB (mem_fraction 0.3 of the GPU)"
    assert free_all >= free_kv  # the weights (a few MiB here) go back to the driver too
    assert abs((free_all - free_back) - (free_all - free0)) < 1 * gib  # resume takes the same memory back
    assert got[1] <= LP_MAX_DIFF


def test_pause_continue_and_abort(engine):
    c = engine.clients[0]
    engine._call(c.pause_generation("abort"))
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("out", engine.generate(_requests(max_new=4))))
    th.start()
    time.sleep(2.0)
    assert "out" not in box, "generation ran while paused"
    engine._call(c.continue_generation())
    th.join(120)
    assert len(box["out"]) == len(PROMPTS) and all(x.finish_reason in ("length", "stop") for x in box["out"])

    long = {}
    payload = {"input_ids": PROMPTS[:2], "return_logprob": True,
               "sampling_params": [{"temperature": 1.0, "max_new_tokens": 3500, "ignore_eos": True}] * 2}
    th = threading.Thread(target=lambda: long.setdefault("out", engine._call(c.generate(payload))))
    t0 = time.perf_counter()
    th.start()
    time.sleep(1.0)
    engine.abort()
    th.join(120)
    took = time.perf_counter() - t0
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in long["out"]]
    _report("abort", {"seconds": took, "finish_reasons": reasons,
                      "tokens": [o["meta_info"]["completion_tokens"] for o in long["out"]]})
    assert reasons == ["abort", "abort"]
    assert engine.health() and engine._call(c.health_generate())


def _wait_for_log(path, offset, text, timeout_s):
    """Until ``text`` appears in the log at ``path`` after byte ``offset`` (polled every 2 ms)."""
    deadline = time.monotonic() + timeout_s
    with open(path, "rb") as f:
        f.seek(offset)
        got = b""
        while time.monotonic() < deadline:
            got += f.read()
            if text.encode() in got:
                return
            time.sleep(0.002)
    raise AssertionError(f"{text!r} not in {path} within {timeout_s} s")


def test_sigkill_mid_rollout_is_recovered_with_every_prompt_answered_once(engine, trainer):
    from megaforge.sync import push_weights

    push_weights(trainer, engine, 64 << 20, 8)
    proc = engine.processes[0]
    pid = proc.pid
    box = {}
    reqs = _requests(max_new=2048, seed=20)  # seconds of decoding: the kill lands mid-rollout

    def run():
        try:
            box["out"] = engine.generate(reqs)
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    th = threading.Thread(target=run)
    seen = os.path.getsize(proc.log_path)
    t0 = time.perf_counter()
    th.start()
    # Killed as soon as the server has prefilled the batch (its log's "Prefill batch" line): after a fixed 1 s
    # the rollout of the trained weights had already ended at EOS on the H200 (2026-12-03), so nothing was
    # in flight to recover.
    _wait_for_log(proc.log_path, seen, "Prefill batch", 120)
    os.killpg(pid, signal.SIGKILL)
    killed_after = time.perf_counter() - t0
    th.join(900)
    took = time.perf_counter() - t0
    assert "err" not in box, box.get("err")
    out = box["out"]
    assert engine.health_metrics()["health/engine_restarts"] == 1.0, (
        f"not restarted: the rollout ended {killed_after:.3f} s in, before the kill "
        f"({sum(len(c.output_ids) for c in out)} tokens)")
    assert proc.pid != pid and proc.alive()
    assert [c.rid for c in out] == [r.rid for r in reqs]  # every prompt answered, once, in order
    assert all(c.weight_version == 8 for c in out)
    got = _lp_diff(trainer, out)
    _report("sigkill_recovery", {"seconds": took, "killed_after_s": killed_after, "max_abs_after": got[1],
                                 "tokens": sum(len(c.output_ids) for c in out)})
    assert got[1] <= LP_MAX_DIFF  # re-synced to the weights it served (from the snapshot)
