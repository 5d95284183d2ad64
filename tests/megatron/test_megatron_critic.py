"""The Megatron backend's PPO critic equals the torch backend's: values and value-loss metrics of
each update, at TP=2 with sequence parallelism (tied-embedding Llama policy), and after a checkpoint
saved there is loaded at PP=2 (critic weights and Adam state restored, training continues equal)."""
import torch

from mt_helpers import run_workers
from worker import critic_batch, critic_cfg, critic_steps

# float32 (eps 1.2e-7). A value is the 64-term dot product of the value head with the last hidden
# state, which four layers of 64- and 96-term sums produce: ~10^3 accumulations along the path, whose
# rounding differs between layouts (TP/SP splits, PP) and CPU kernels by ~sqrt(K) * eps ~ 4e-6 relative
# (|V| <= 0.2 here: ~1e-6); the three Adam updates, in the regime where the loss falls every update
# (critic_cfg), add a weight error of ~lr x the gradients' relative rounding. Measured worst case:
# 1.0e-7 over ATen avx512 / avx2 / default and MKL AVX2 kernels; the bound is 100x that. The metrics
# (sums over the batch's 50 trained tokens and the critic's 140k parameters) are compared relative to their size.
TOL = 1e-5


def torch_critic_reference(path: str, n: int):
    from megaforge.build import RunBuilder
    from megaforge.trainer.torch_backend import TorchTrainer

    tr = TorchTrainer(RunBuilder(critic_cfg(path, "torch")).trainer_spec())
    tr.init_critic()
    batch = critic_batch()
    v0 = tr.compute_values(batch)
    metrics, values = critic_steps(tr, batch, n)
    return v0, metrics, values


def _close(got: torch.Tensor, want: torch.Tensor, what: str):
    d = float((got - want).abs().max())
    assert d <= TOL, f"{what}: max |megatron - torch| = {d:.3g}"


def test_critic_tp2_sp_matches_torch_and_resumes_at_pp2(tiny_models, tmp_path):
    path = tiny_models["llama_tied"]
    spec = {"model": path, "layout1": {"tp": 2, "sp": True}, "layout2": {"pp": 2}, "steps1": 2, "steps2": 1,
            "ckpt": str(tmp_path / "ckpt")}
    r = run_workers("critic", 2, spec, tmp_path)[0]
    v0, ref_m, ref_v = torch_critic_reference(path, 3)
    assert float(v0.abs().max()) == 0.0 and float(r["values0"].abs().max()) == 0.0  # zero head at the start
    got_m = r["metrics1"] + r["metrics2"]
    got_v = r["values1"] + r["values2"]
    for i, (g, w) in enumerate(zip(got_m, ref_m)):
        for k in ("critic/loss", "critic/grad_norm", "critic/values", "critic/returns"):
            assert abs(g[k] - w[k]) <= TOL * max(1.0, abs(w[k])), f"update {i + 1} {k}: {g[k]} vs torch {w[k]}"
    for i, (g, w) in enumerate(zip(got_v, ref_v)):
        _close(g, w, f"values after update {i + 1}")
    losses = [m["critic/loss"] for m in ref_m]
    assert losses[0] > losses[1] > losses[2], losses  # the well-conditioned regime the bound assumes
    assert float(ref_v[2].abs().max()) > 0.1  # the critic learned something, 10^4 x TOL, to compare
    _close(r["values_loaded"], r["values1"][-1], "values after loading the TP=2 checkpoint at PP=2")
