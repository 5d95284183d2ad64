"""tools/check_parity.py and tools/bench/bench_train.py run and report (CPU, gloo)."""
import json
import os

import pytest

from mt_helpers import ROOT, run_ranks, tails

PARITY = os.path.join(ROOT, "tools", "check_parity.py")
SHIFTED = os.path.join(ROOT, "tests", "megatron", "parity_shifted.py")


def _json_line(log: str) -> dict:
    lines = [ln for ln in log.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, log[-3000:]
    return json.loads(lines[0])


def _check_parity_passes(tiny_models, tmp_path, args: list, ranks: int, tokens: int) -> dict:
    """tools/check_parity.py on ``ranks`` ranks passes; ``--seq 32``: rows of lengths 8, 16, 24, 32, so
    7 + 15 + 23 + 31 = 76 predicted tokens."""
    codes, logs = run_ranks([PARITY, "--hf", tiny_models["qwen2"], *args], ranks, tmp_path, "parity")
    assert codes == [0] * ranks, tails(logs)
    rep = _json_line(logs[0])
    # float32 logprobs (|lp| ~ 5.5, ulp 4.8e-7) after 4 layers of 64/96-term sums and a 250-way
    # log-softmax, TP=2 + SP against unsplit transformers: measured <= 9.5e-7 (2 ulp) on ATen avx512 /
    # avx2 / default and MKL AVX2 kernels (one rank: less); 1e-5 is ~20 ulp. Argmax: the smallest top-2 logit gap of
    # the 76 positions is 1.2e-4 (transformers), 100x the logits' rounding, so agreement is exact.
    assert rep["ok"] and rep["max_abs_logprob_diff"] <= 1e-5 and rep["argmax_agreement"] == 1.0, rep
    assert rep["family"] == "qwen2" and rep["tokens"] == tokens, rep
    assert all(not ln.startswith("{") for log in logs[1:] for ln in log.splitlines()), "only rank 0 reports"
    return rep


@pytest.mark.slow  # ~27 s; the parity it reports is test_megatron_parity's (default run)
def test_check_parity_passes_and_fails_above_tol(tiny_models, tmp_path):
    """One rank (the tool's reading of the model, its JSON line, its exit codes); TP=2 + SP: slow test below."""
    rep = _check_parity_passes(tiny_models, tmp_path, ["--seq", "32"], 1, 76)
    assert (rep["tp"], rep["sp"]) == (1, False), rep
    # must fail by construction: the reference shifted by 1e-3 puts every difference within 1e-5
    # (the parity error above) of 1e-3, above --tol 5e-4 on any machine
    codes, logs = run_ranks([SHIFTED, "1e-3", "--hf", tiny_models["qwen2"], "--tol", "5e-4", "--seq", "16"], 1,
                            tmp_path, "parity_fail")
    assert codes == [1], tails(logs)
    rep = _json_line(logs[0])
    assert rep["ok"] is False and rep["tol"] == 5e-4 and abs(rep["max_abs_logprob_diff"] - 1e-3) <= 1e-5, rep


@pytest.mark.slow  # 2 ranks, ~45 s; the same layout's parity is in test_megatron_parity's default tests
def test_check_parity_tp2_sp_passes(tiny_models, tmp_path):
    rep = _check_parity_passes(tiny_models, tmp_path, ["--tp", "2", "--sp", "--seq", "32"], 2, 76)
    assert (rep["tp"], rep["sp"]) == (2, True), rep


@pytest.mark.slow  # ~14 s; a benchmark (run on the H200: docs/benchmarks); the train step: tests/megatron
def test_bench_train_tiny_runs_both_steps(tmp_path):
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench", "bench_train.py"), "--tiny"], 1, tmp_path, "bench")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert rep["ours_tflops_per_gpu"] > 0 and rep["raw_tflops_per_gpu"] > 0 and rep["tokens_per_step"] == 4 * 64
    assert rep["ours_allocator"] is None and rep["raw_allocator"] is None  # CUDA's allocator counters only
    assert (rep["mbs"], rep["micro_batches"]) == (2, 2)


@pytest.mark.slow  # ~12 s, a benchmark's option
def test_bench_train_mbs_sets_the_micro_batch_geometry(tmp_path):
    # --mbs 1: each of the 2 micro-batches is one 64-token row for raw and 2 rows packing 64 tokens for ours
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench", "bench_train.py"), "--tiny", "--mbs", "1"], 1, tmp_path,
                            "bench")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert (rep["mbs"], rep["micro_batches"], rep["tokens_per_step"]) == (1, 2, 2 * 64)


@pytest.mark.slow  # ~16 s, a benchmark's option
def test_bench_train_lora_times_the_adapted_step_beside_the_full_one(tmp_path):
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench", "bench_train.py"), "--tiny", "--lora_rank", "4"], 1,
                            tmp_path, "bench")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert rep["layer_spec"] == rep["lora_layer_spec"] == "torch" and (rep["lora_rank"], rep["lora_alpha"]) == (4, 8.0)
    # the tiny shape (2 layers, hidden 64, ffn 128, 4 heads / 2 kv heads of 16): rank 4 on q, k, v, o, gate, up,
    # down = 4 x ((64 + 64) + 2 (64 + 32) + (64 + 64) + 2 (64 + 128) + (128 + 64)) = 4,096 a layer, the base frozen
    assert rep["lora_trainable_params"] == 2 * 4096, rep
    assert rep["lora_step_s"] > 0 and rep["lora_over_full"] == rep["lora_step_s"] / rep["ours_step_s"]


def test_bench_train_lora_refuses_the_te_spec():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "bench_train.py"), "--lora_rank", "4",
                        "--layer_spec", "te"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--lora_rank needs --layer_spec torch" in r.stderr, r.stderr[-2000:]


def test_bench_train_tiny_moe_randomly_initialised_runs_each_expert_variant(tmp_path):
    """A Qwen3-MoE shape from its config alone (random init: transformers holds the experts fused, the
    converter reads per-expert tensors) trains in both steps; the FLOPs count the k routed experts."""
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench", "bench_train.py"), "--tiny", "--shape", "tinymoe",
                             "--moe_experts", "sequential,auto"], 1, tmp_path, "bench")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert sorted(rep["variants"]) == ["auto", "sequential"] and rep["layer_spec"] == "torch"
    assert all(v["moe_experts"] == "sequential" and v["ours_tflops_per_gpu"] > 0 for v in rep["variants"].values())
    # 2 layers of 4 experts top-2, expert FFN 32, hidden 64: 2 of the 4 experts' 3 x 64 x 32 weights are active
    assert rep["params"] - rep["active_params"] == 2 * 2 * 3 * 64 * 32, rep


def test_trace_gaps_charges_idle_gpu_time_to_the_host_work_running_meanwhile():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
    from trace_gaps import gaps_report

    def ev(cat, name, ts, dur, tid=1, pid=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}

    events = [
        ev("user_annotation", "phase1", 0, 150),
        ev("cpu_op", "A", 0, 100), ev("cuda_runtime", "cudaLaunchKernel", 5, 3),
        ev("cpu_op", "B", 100, 100), ev("cuda_runtime", "cudaLaunchKernel", 175, 3),
        ev("cpu_op", "bwd_op", 200, 200, tid=2),  # another thread (autograd's), started later than C
        ev("cpu_op", "C", 190, 300),
        ev("kernel", "k1", 10, 40, pid=0, tid=7), ev("kernel", "k2", 180, 120, pid=0, tid=7),
        ev("gpu_memcpy", "copy", 290, 30, pid=0, tid=8),  # overlaps k2: merged into one busy interval
        ev("kernel", "k3", 450, 10, pid=0, tid=7),
        ev("cuda_runtime", "cudaFree", 120, 20), ev("cuda_runtime", "cudaFree", 140, 5),  # inside B and phase1
        ev("cuda_runtime", "cudaStreamSynchronize", 20, 30),  # inside A and phase1, while k1 runs: no idle
        ev("cuda_runtime", "cudaMemcpyAsync", 60, 2),  # not a sync
    ]
    rep = gaps_report(events, sample_us=1.0)
    # busy [10, 50] + [180, 320] + [450, 460]; idle [0, 10] + [50, 180] + [320, 450]
    assert rep["busy_s"] == 190e-6 and rep["idle_s"] == 270e-6 and rep["gaps"] == 3, rep
    by_op = {k: round(v * 1e6) for k, v in rep["idle_by_op"].items()}
    # the launches (5-8, 175-178) inside A and B; [320, 400] bwd_op (started after C), [400, 450] C
    # the runtime calls inside A and B take their idle samples: [120, 145] cudaFree, [60, 62] the copy
    assert by_op == {"A": 55, "B": 52, "cudaFree": 25, "cudaMemcpyAsync": 2, "cudaLaunchKernel": 6, "bwd_op": 80,
                     "C": 50}, by_op
    assert rep["host_syncs"] == {"cudaFree @ phase1": [2, 25e-6], "cudaStreamSynchronize @ phase1": [1, 30e-6]}, rep
    by_phase = {k: round(v * 1e6) for k, v in rep["idle_by_phase"].items()}
    assert by_phase == {"phase1": 110, "(none)": 160}, by_phase


def test_bench_train_allocator_churn_is_each_counters_increase_and_none_off_cuda():
    import sys

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
    from bench_train import allocator_churn, allocator_counts

    before = {"num_alloc_retries": 0, "num_device_alloc": 40, "num_device_free": 3}
    after = {"num_alloc_retries": 2, "num_device_alloc": 47, "num_device_free": 9}
    assert allocator_churn(before, after) == {"alloc_retries": 2, "device_alloc": 7, "device_free": 6}
    assert allocator_counts(torch.device("cpu")) is None and allocator_churn(None, None) is None


@pytest.mark.slow  # ~30 s; the tool's real run is on the GPU (tools/gpu/h200_session.sh bench_step)
def test_bench_grpo_step_tiny_reports_the_step_beside_its_parts(tmp_path):
    """tools/bench/bench_grpo_step.py on the CPU (tiny model, embedded server, megatron trainer): the colocated
    steps, the engine alone on the last step's requests, the train step alone on its batch and raw
    megatron-core on as many tokens, one JSON line with every figure its targets are read from."""
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench", "bench_grpo_step.py"), "--tiny", "--limit_gpu", "H200"],
                            1, tmp_path, "grpo_step")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert len(rep["steps"]) == 2 and rep["step"] == rep["steps"][-1]
    assert rep["tokens_per_step"] > 0 and rep["tokens_per_s_per_gpu"] > 0
    assert rep["engine_alone"]["requests"] == 4 and rep["engine_alone"]["sampled_tokens"] > 0
    assert rep["train_alone"]["train_step_s"] > 0 and rep["raw"]["seconds"] > 0 and rep["raw"]["tokens"] > 0
    assert set(rep["targets"]) == {"overhead_le_0.05", "step_vs_parts_le_1.10", "first_step_offload_le_2s"}
    assert 0 <= rep["step"]["overhead"] < 1 and rep["step_vs_parts"] > 0
    lim = rep["limit"]  # the estimate for an H200 (tools/bench/step_limit.py) of this very batch
    assert lim["tokens"] == rep["tokens_per_step"] and lim["peak_flops"] == 989.4e12 and lim["forward_passes"] >= 1
    assert lim["decode_s"] > 0 and lim["train_s"] > 0 and rep["tokens_per_s_vs_limit"] > 0


@pytest.mark.slow  # ~17 s; a benchmark (run on the H200: docs/benchmarks); save / verify / load: tests/test_checkpoint.py, tests/megatron
def test_bench_checkpoint_times_save_verify_load_and_cleans_up(tmp_path):
    """tools/bench/bench_checkpoint.py on the CPU demo's model with the megatron trainer: one JSON line with
    the checkpoint's size and phases, and --dir left without the checkpoint."""
    where = tmp_path / "ckpt"
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench", "bench_checkpoint.py"), "--config",
                             os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--dir", str(where),
                             "--trainer.backend", "megatron"], 1, tmp_path, "bench_ckpt")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert rep["bench"] == "checkpoint" and rep["backend"] == "megatron" and rep["world"] == 1, rep
    # weights + Adam's two moments of the demo model, float32: well over 1 MB (13.2 MB measured)
    assert rep["bytes"] > 1e6 and rep["save_s"] > 0 and rep["verify_s"] >= 0 and rep["load_s"] > 0, rep
    assert rep["write_gb_s"] > 0 and rep["host_peak_rss_gib_after_save"] > 0, rep
    assert not (where / "checkpoints").exists(), "the checkpoint is removed without --keep"


def test_bench_train_reports_a_step_out_of_memory_and_times_the_other(tmp_path):
    # raw's step raises torch.OutOfMemoryError (tests/megatron/bench_raw_oom.py: the CPU cannot run out of CUDA
    # memory); the JSON line names raw's error, has no raw figures or ratio, and ours is still timed
    codes, logs = run_ranks([os.path.join(ROOT, "tests", "megatron", "bench_raw_oom.py"), "--tiny"], 1, tmp_path, "bench")
    assert codes == [0], tails(logs)
    rep = _json_line(logs[0])
    assert rep["raw_error"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 9.27 GiB"), rep
    assert rep["raw_step_s"] is None and rep["raw_tflops_per_gpu"] is None and rep["ratio"] is None, rep
    assert rep["ours_step_s"] > 0 and rep["ours_tflops_per_gpu"] > 0 and "ours_error" not in rep, rep


@pytest.mark.slow  # ~20 s, a benchmark's option
def test_bench_train_profile_names_the_host_ops_by_phase_and_stack(tmp_path):
    """--profile writes, per step, its host time by phase (ours: megaforge.forward, megaforge.loss, ...; raw:
    raw.forward, its loss inside; autograd's thread: (backward)) and by outermost aten op and python stack:
    ours' packed attention (the CPU path scatters rows with index_copy in megaforge's layers.py) shows under
    megaforge.forward and not in raw's file, whose cross entropy (megatron's, inside its forward) shows under
    raw.forward only."""
    prof = tmp_path / "prof"
    codes, logs = run_ranks([os.path.join(ROOT, "tools", "bench", "bench_train.py"), "--tiny", "--profile", str(prof)],
                            1, tmp_path, "bench")
    assert codes == [0], tails(logs)
    ours = (prof / "ours_host_ops.txt").read_text()
    raw = (prof / "raw_host_ops.txt").read_text()
    head, _, body = ours.partition("\n\n")
    assert "  megaforge.forward: " in head and "  megaforge.loss: " in head and "raw.forward" not in head, head
    assert "  raw.forward: " in raw.partition("\n\n")[0] and "megaforge." not in raw.partition("\n\n")[0], raw[:500]
    entry = next(b for b in body.split("\n\n") if b.startswith("[megaforge.forward] aten::index_copy "))
    assert "megaforge/trainer/megatron/layers.py" in entry and "_attend_padded" in entry, entry
    assert "_attend_padded" not in raw and "cross_entropy" not in ours
    assert any(b.startswith("[raw.forward] ") and "megatron/core/tensor_parallel/cross_entropy.py" in b
               for b in raw.split("\n\n")), raw[:3000]
