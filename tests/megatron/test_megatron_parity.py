"""The Megatron backend against Hugging Face transformers and the torch backend, on real gloo
process groups (TP, PP, CP, SP, DP), fp32. Each test is one multi-process launch."""
import os

import pytest
import torch

from mt_helpers import hf_logprobs, make_batch, run_workers, torch_backend_reference

# float32 logprobs (|lp| ~ 5.5, ulp 4.8e-7) of 4 layers of 64/96-term sums and a 250-way log-softmax.
# Two layouts (or Megatron and transformers) sum in other orders, and the CPU's kernels pick the order
# too: measured <= 9.5e-7 (2 ulp) over ATen avx512 / avx2 / default and MKL AVX2 kernels, for every
# comparison of logprobs below (HF, packed vs one row per micro-batch, after a reshard). TOL is ~20 ulp.
# Metrics (loss, entropy, grad norm: sums over 50 tokens and ~140k parameters) compare relative to size.
TOL = 1e-5
# Weights after Adam steps: the first steps move a weight by lr * g / (|g| + eps); where |g| <~ eps
# (1e-6) that is lr * g / eps, so the float32 rounding of such a gradient is amplified lr / eps = 1e3
# times. Measured <= 2.0e-6 (ATen avx512 / avx2 / default, MKL AVX2), which sat within 5x of the old
# 1e-5; a sign error or a missing gradient moves a weight by ~lr = 1e-3.
WEIGHT_TOL = 3e-5


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a - b).abs().max().item()


def _check_logprobs(results, tiny_models, expected_keys):
    batch = make_batch()
    refs = {name: hf_logprobs(tiny_models[name], batch, temperature=0.8) for name in {k[0] for k in expected_keys}}
    assert set(results[0]) == expected_keys
    for (name, layout), r in results[0].items():
        for kind in ("packed", "single"):
            d = _max_diff(r[kind], refs[name])
            assert d <= TOL, f"{name} {layout} {kind}: max |logprob - HF| = {d:.3g}"
        d = _max_diff(r["packed"], r["single"])
        assert d <= TOL, f"{name} {layout}: packed vs one-row micro-batches differ by {d:.3g}"
        # positions="trained": the same forward, masked to loss_mask > 0 (exact, within one run)
        assert torch.equal(r["trained"], r["packed"] * (batch.loss_mask > 0)), f"{name} {layout}: trained positions"
        for other in results[1:]:
            # every rank ends with the same reduced / broadcast bits: exact, within one run
            assert torch.equal(other[(name, layout)]["packed"], r["packed"]), f"{name} {layout}: ranks disagree"
    for rank in results:  # a share's log-probs: its rows of the whole batch's, computed the same way (exact)
        for (name, layout), r in rank.items():
            rows = torch.tensor(r["share_rows"])
            assert r["share"].shape[0] == len(rows) and (r["dp"] == 1 or len(rows) < batch.batch_size)
            assert torch.equal(r["share"], r["packed"][rows, : r["share"].shape[1]]), f"{name} {layout}: share rows"
        assert (r["packed"][batch.lengths[:, None] <= torch.arange(batch.tokens.shape[1])] == 0).all()


def _run_logprobs(tiny_models, runs, nprocs, tmp_path):
    spec = {"runs": [(name, tiny_models[name], layout) for name, layout in runs]}
    res = run_workers("logprobs", nprocs, spec, tmp_path)
    keys = {(name, "_".join(f"{k}{int(v)}" for k, v in sorted(layout.items()))) for name, layout in runs}
    _check_logprobs(res, tiny_models, keys)


def test_logprobs_equal_hf_on_2_ranks(tiny_models, tmp_path):
    """TP=2, PP=2, CP=2 and TP=2 + sequence parallel for Llama (tied), Qwen2, Qwen3."""
    layouts = [{"tp": 2}, {"pp": 2}, {"cp": 2}, {"tp": 2, "sp": True}]
    _run_logprobs(tiny_models, [(n, l) for n in tiny_models for l in layouts], 2, tmp_path)


def test_logprobs_equal_hf_on_4_ranks(tiny_models, tmp_path):
    """TP=2 x PP=2 for the tied Llama (the embedding shared by the first and last stage); CP=2 x TP=2 + SP;
    TP=2 x DP=2 (rows split over DP). The other families at TP=2 x PP=2: the slow test below."""
    tied = [n for n in tiny_models if n.startswith("llama")]
    assert tied, sorted(tiny_models)
    runs = [(tied[0], {"tp": 2, "pp": 2}), ("qwen3", {"cp": 2, "tp": 2, "sp": True}), ("qwen2", {"tp": 2})]
    _run_logprobs(tiny_models, runs, 4, tmp_path)


@pytest.mark.slow  # 4 ranks, ~35 s
def test_logprobs_equal_hf_on_4_ranks_every_family(tiny_models, tmp_path):
    """TP=2 x PP=2 for every family."""
    _run_logprobs(tiny_models, [(n, {"tp": 2, "pp": 2}) for n in tiny_models], 4, tmp_path)


def _check_weights(got: dict, want: dict, what: str, tol: float = WEIGHT_TOL):
    missing = set(want) - set(got) - {"lm_head.weight"}  # tied lm_head is not a separate tensor
    assert not missing, f"{what}: not streamed: {sorted(missing)}"
    worst = max(((_max_diff(got[k], want[k].float()), k) for k in got), default=(0.0, None))
    assert worst[0] <= tol, f"{what}: {worst[1]} differs by {worst[0]:.3g}"


def _check_metrics(got: dict, want: dict, what: str):
    for k in ("loss", "pg_loss", "entropy", "clip_frac", "grad_norm", "lr"):
        if k in want:
            assert abs(got[k] - want[k]) <= TOL * max(1.0, abs(want[k])), f"{what} {k}: {got[k]} vs torch {want[k]}"


def test_train_step_tp2_matches_torch_backend_and_checkpoint_reshards_to_pp2(tiny_models, tmp_path):
    """Qwen3 (q/k norm): an RL step at TP=2 equals the torch backend (loss, metrics, updated
    weights); the dist checkpoint saved at TP=2 loads at PP=2 with identical weights and
    logprobs, and the next RL and SFT steps (Adam state restored) still equal the torch backend.
    The HF export of the result loads in transformers."""
    path = tiny_models["qwen3"]
    spec = {"model": path, "layout1": {"tp": 2}, "layout2": {"pp": 2}, "steps1": ["rl"], "steps2": ["rl", "sft"],
            "ckpt": str(tmp_path / "ckpt"), "export": str(tmp_path / "hf_out"), "bucket_bytes": 40_000, "ref": True}
    res = run_workers("train", 2, spec, tmp_path)
    r = res[0]
    ref_m, ref_w = torch_backend_reference(path, make_batch(), ["rl", "rl", "sft"])
    _check_metrics(r["metrics1"][0], ref_m[0], "step 1 (tp2)")
    _check_weights(r["weights1"], ref_w[0], "weights after step 1 (tp2)")
    assert r["n_buckets"] > 3, "40 kB buckets should split the model"
    assert res[1]["weights1"] == {}, "only global rank 0 receives HF tensors"
    assert r["version1"] == 1 and r["version2_loaded"] == 1
    for k, v in r["weights1"].items():
        assert torch.equal(r["weights2_loaded"][k], v), f"{k} changed through save (tp2) / load (pp2)"
    assert _max_diff(r["lp2_loaded"], r["lp1"]) <= TOL  # the same weights at PP=2: only the sum order changed
    # the frozen reference: the initial policy, kept through training and the checkpoint
    assert _max_diff(r["ref0"], hf_logprobs(path, make_batch(), temperature=0.8)) <= TOL
    assert _max_diff(r["ref_loaded"], r["ref0"]) <= TOL and _max_diff(r["lp1"], r["ref0"]) > 1e-3
    _check_metrics(r["metrics2"][0], ref_m[1], "step 2 (pp2, after resume)")
    _check_metrics(r["metrics2"][1], ref_m[2], "sft step 3 (pp2)")
    _check_weights(r["weights2"], ref_w[2], "weights after step 3 (pp2)")

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(spec["export"], dtype=torch.float32)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, r["weights2"][k]), f"export: {k} differs from the streamed weights"
    assert os.path.exists(os.path.join(spec["export"], "tokenizer_config.json"))
    assert not os.path.exists(spec["export"] + ".tmp")


def test_token_budget_micro_batches_train_like_the_torch_backend(tiny_models, tmp_path):
    """trainer.micro_batch_tokens 24 at TP=2: rows of 20, 7, 13, 3, 17 tokens packed end to end as
    [20], [7, 13, 3], [17] (micro_batch_size 5 rows would be one micro-batch); the RL step's metrics
    and weights equal the torch backend's at 2 rows a micro-batch (losses are sums of per-row terms
    over the mini-batch's denominators: the cut changes the summation order only; TOL as above)."""
    path = tiny_models["qwen2"]
    spec = {"model": path, "layout1": {"tp": 2}, "steps1": ["rl"], "ckpt": str(tmp_path / "ckpt"),
            "trainer": {"micro_batch_size": 5, "micro_batch_tokens": 24}}
    r = run_workers("train", 2, spec, tmp_path)[0]
    assert r["micro_batch_rows"] == [1, 3, 1]
    ref_m, ref_w = torch_backend_reference(path, make_batch(), ["rl"])
    _check_metrics(r["metrics1"][0], ref_m[0], "rl step (tp2, token budget)")
    _check_weights(r["weights1"], ref_w[0], "weights after the rl step (tp2, token budget)")


@pytest.mark.slow
def test_train_tied_llama_tp2_pp2_then_tp2_dp2_sp(tiny_models, tmp_path):
    """Llama with tied embeddings at TP=2 x PP=2 (1F1B over 3 micro-batches, two mini-batches =
    two optimizer steps), saved, resumed at TP=2 x DP=2 with sequence parallelism and the
    distributed optimizer sharded over DP: every step equals the torch backend."""
    path = tiny_models["llama_tied"]
    kw = {"mini_batches": 2, "micro_batch_size": 1}
    spec = {"model": path, "layout1": {"tp": 2, "pp": 2}, "layout2": {"tp": 2, "sp": True}, "steps1": ["rl"], "steps2": ["rl"],
            "ckpt": str(tmp_path / "ckpt"), "trainer": kw, "export": str(tmp_path / "hf_tied")}
    res = run_workers("train", 4, spec, tmp_path)
    r = res[0]
    ref_m, ref_w = torch_backend_reference(path, make_batch(), ["rl", "rl"], **kw)
    assert r["version1"] == 2
    _check_metrics(r["metrics1"][0], ref_m[0], "rl step 1 (tp2 pp2)")
    _check_weights(r["weights1"], ref_w[0], "weights after rl step 1 (tp2 pp2)")
    for k, v in r["weights1"].items():
        assert torch.equal(r["weights2_loaded"][k], v), f"{k} changed through save / load"
    _check_metrics(r["metrics2"][0], ref_m[1], "rl step 2 (tp2 dp2 sp)")
    _check_weights(r["weights2"], ref_w[1], "weights after rl step 2 (tp2 dp2 sp)")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(spec["export"], dtype=torch.float32)
    assert hf.config.tie_word_embeddings and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert torch.equal(hf.model.embed_tokens.weight, r["weights2"]["model.embed_tokens.weight"])
    assert "lm_head.weight" not in r["weights2"]


def test_reset_optimizer_makes_the_one_optimizer_fresh(tiny_models, tmp_path):
    """The optimizer is built once; reset_optimizer (a phase's start) clears its Adam state: after steps
    at lr 0 (moments and step counts, the weights unmoved), a reset trainer's RL step equals a fresh
    trainer's. Exact: the same ops in the same order in one process (not a cross-machine rounding
    claim); without the reset, the moments and bias correction move the weights by ~lr."""
    r = run_workers("reset", 1, {"model": tiny_models["qwen2"], "layout": {"dist_opt": True}}, tmp_path)[0]
    assert r["state_before"] > 0 and r["state_after"] == 0 and r["same_optimizer"]
    assert r["metrics"] == r["fresh_metrics"]
    for k, v in r["fresh_weights"].items():
        assert torch.equal(r["weights"][k], v), f"{k}: reset trainer differs from a fresh one"
