"""One rank of a multi-process Megatron backend test (launched by mt_helpers.run_workers).

    python worker.py SCENARIO SPEC.json OUTDIR

Scenarios:
* ``logprobs``: for every (name, model dir, layout) in ``runs``, build a MegatronTrainer and record
  compute_logprobs of the shared batch (packed several rows per micro-batch, and one per micro-batch;
  positions="trained" too),
  and of the rank's data-parallel share of it (its rows only, nothing gathered).
* ``train``: train / SFT steps at one layout, HF weights via iter_hf_buckets, save; reload at a
  second layout, logprobs and weights again, more steps, export_hf.
* ``reset``: ``reset_optimizer`` after steps against a fresh trainer (the optimizer is built once).
* ``warm_up``: Trainer.warm_up then an RL step, beside a fresh trainer's first RL step.
* ``warm_up_cuda``: torch.compile graphs of a cold trainer's first RL step, and of one after warm_up.
* ``old_first_update``: pi_old without the first mini-batch's rows, then an RL step, beside pi_old of every row.
* ``opt_state``: after RL steps at one layout, the optimizer's fully reshardable sharded state dict as
  megaforge saves it (no gather at one DP rank) beside megatron's own, entry by entry.
* ``te_cuda``: the TE layer spec on CUDA in bfloat16 (FP8 where ``fp8`` is set) beside the torch spec:
  HF weights in and out, logprobs, RL steps, save / load, export_hf (tests/gpu/test_megatron_te_cuda.py).
Results go to OUTDIR/SCENARIO.rank{R}.pt.
"""
from __future__ import annotations

import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def layout_name(layout: dict) -> str:
    return "_".join(f"{k}{int(v)}" for k, v in sorted(layout.items()))


def hf_weights(trainer, max_bytes: int) -> tuple[dict, int]:
    out, n = {}, 0
    for bucket in trainer.iter_hf_buckets(max_bytes):
        n += 1
        for name, t in bucket:
            assert name not in out, f"{name} streamed twice"
            out[name] = t.detach().cpu().clone()
    return out, n


def run_steps(tr, batch, kinds: list[str]) -> list[dict]:
    return [tr.train_step(batch) if k == "rl" else tr.sft_step(batch) for k in kinds]


def step_beside_fresh(tr, cfg, batch, res) -> None:
    """One RL step of ``tr`` (then closed) and a fresh trainer's first RL step on the same ``batch``:
    ``metrics`` / ``weights`` beside ``fresh_metrics`` / ``fresh_weights``."""
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    res["metrics"] = run_steps(tr, batch, ["rl"])
    res["weights"], _ = hf_weights(tr, 1 << 30)
    tr.close()
    fresh = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    res["fresh_metrics"] = run_steps(fresh, batch, ["rl"])
    res["fresh_weights"], _ = hf_weights(fresh, 1 << 30)
    fresh.close()


def scenario_logprobs(spec, res):
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.data.batch import share_of, share_rows
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch = make_batch()
    for name, path, layout in spec["runs"]:
        t0 = time.time()
        tr = MegatronTrainer(RunBuilder(trainer_cfg(path, layout=layout, micro_batch_size=batch.batch_size)).trainer_spec())
        packed = tr.compute_logprobs(batch)
        trained = tr.compute_logprobs(batch, positions="trained")  # what the loop asks for pi_old / the reference
        share = share_of(batch, 1, *tr.data_parallel())  # this DP rank's rows, as the loop hands them off
        share_lp = tr.compute_logprobs(share)
        tr.cfg.trainer.micro_batch_size = 1
        single = tr.compute_logprobs(batch)
        res[(name, layout_name(layout))] = {"packed": packed, "single": single, "s": time.time() - t0, "trained": trained,
                                            "share": share_lp, "dp": tr.data_parallel()[1],
                                            "share_rows": share_rows(batch.batch_size, 1, *tr.data_parallel())}
        tr.close()


def scenario_train(spec, res):
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch = make_batch()
    kw = spec.get("trainer", {})
    tr = MegatronTrainer(RunBuilder(trainer_cfg(spec["model"], layout=spec["layout1"], **kw)).trainer_spec())
    if spec.get("ref"):
        tr.snapshot_reference()
        res["ref0"] = tr.compute_logprobs(batch, "ref")
    res["micro_batch_rows"] = [mb.rows.batch_size for mb in tr.micro_batches(batch)]
    res["metrics1"] = run_steps(tr, batch, spec["steps1"])
    res["weights1"], res["n_buckets"] = hf_weights(tr, spec.get("bucket_bytes", 40_000))
    res["lp1"] = tr.compute_logprobs(batch)
    res["version1"] = tr.version
    tr.save(spec["ckpt"])
    tr.close()
    if "layout2" not in spec:
        return
    tr = MegatronTrainer(RunBuilder(trainer_cfg(spec["model"], layout=spec["layout2"], **kw)).trainer_spec())
    tr.load(spec["ckpt"])
    res["version2_loaded"] = tr.version
    res["lp2_loaded"] = tr.compute_logprobs(batch)
    if spec.get("ref"):
        res["ref_loaded"] = tr.compute_logprobs(batch, "ref")
    res["weights2_loaded"], _ = hf_weights(tr, 1 << 30)
    res["metrics2"] = run_steps(tr, batch, spec.get("steps2", []))
    res["weights2"], _ = hf_weights(tr, 1 << 30)
    if spec.get("export"):
        tr.export_hf(spec["export"])
    tr.close()


def critic_batch():
    """make_batch() with V_old = 0 and seeded returns (the critic's targets)."""
    import torch

    from mt_helpers import make_batch

    batch = make_batch()
    g = torch.Generator().manual_seed(1)
    batch.values = torch.zeros(batch.tokens.shape)
    batch.returns = torch.randn(batch.tokens.shape, generator=g) * batch.loss_mask
    return batch


def critic_cfg(path: str, backend: str = "megatron", layout=None, **kw):
    """trainer_cfg with a PPO critic. critic.lr 1e-3: values move to |V| ~ 0.2 in three updates while
    the value loss falls every update. At 1e-2 the third update overshoots (loss 0.58 -> 1.17, grad
    norm 1.3 -> 11) and Adam's per-parameter normalisation amplifies float32 rounding of the
    gradients 100-fold: two correct implementations then differ by 1e-5..2.5e-5 depending on the
    CPU's kernels, which no bound justified by the arithmetic covers."""
    from mt_helpers import trainer_cfg

    cfg = trainer_cfg(path, backend, layout, **kw)
    cfg.critic.lr = 1e-3
    return cfg


def critic_steps(tr, batch, n: int) -> tuple[list, list]:
    """``n`` critic updates, each on the batch with V_old = the current values; (metrics, values)."""
    metrics, values = [], []
    for _ in range(n):
        batch.values = tr.compute_values(batch)
        metrics.append(tr.train_critic(batch))
        values.append(tr.compute_values(batch))
    return metrics, values


def scenario_critic(spec, res):
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch = critic_batch()
    kw = spec.get("trainer", {})
    tr = MegatronTrainer(RunBuilder(critic_cfg(spec["model"], layout=spec["layout1"], **kw)).trainer_spec())
    tr.init_critic()
    res["values0"] = tr.compute_values(batch)
    res["metrics1"], res["values1"] = critic_steps(tr, batch, spec["steps1"])
    res["lp1"] = tr.compute_logprobs(batch)
    tr.save(spec["ckpt"])
    tr.close()
    tr = MegatronTrainer(RunBuilder(critic_cfg(spec["model"], layout=spec["layout2"], **kw)).trainer_spec())
    tr.load(spec["ckpt"])  # restores the critic (weights, Adam state)
    res["values_loaded"] = tr.compute_values(batch)
    res["metrics2"], res["values2"] = critic_steps(tr, batch, spec["steps2"])
    tr.close()


def scenario_reset(spec, res):
    """Steps at lr 0 (Adam moments and step counts, the weights unmoved), reset_optimizer, one RL step;
    and a fresh trainer's first RL step, for comparison."""
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.memory.state import megatron_parts
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch, cfg = make_batch(), trainer_cfg(spec["model"], layout=spec["layout"])
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    opt = tr.optimizer
    tr.reset_optimizer(0.0, 4)
    run_steps(tr, batch, ["rl", "sft"])
    res["state_before"] = sum(len(o.optimizer.state) for o in megatron_parts(tr.optimizer))
    tr.reset_optimizer(cfg.trainer.lr, 4)
    res["same_optimizer"] = tr.optimizer is opt
    res["state_after"] = sum(len(o.optimizer.state) for o in megatron_parts(tr.optimizer))
    step_beside_fresh(tr, cfg, batch, res)


def scenario_warm_up(spec, res):
    """Trainer.warm_up, then one RL step; and a fresh trainer's first RL step, for comparison: weights,
    gradient buffers, optimizer state and the random streams after the warm-up, and the step's results."""
    import torch
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.memory.state import megatron_parts
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch, cfg = make_batch(), trainer_cfg(spec["model"], layout=spec["layout"])
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    res["weights0"], _ = hf_weights(tr, 1 << 30)
    rng = torch.get_rng_state()
    tr.warm_up()
    res["rng_kept"] = torch.equal(rng, torch.get_rng_state())
    res["weights_warm"], _ = hf_weights(tr, 1 << 30)
    res["grad_abs_sum"] = sum(float(b.grad_data.abs().sum()) for b in tr.ddp.buffers)
    res["opt_state"] = sum(len(o.optimizer.state) for o in megatron_parts(tr.optimizer))
    res["version"] = tr.version
    step_beside_fresh(tr, cfg, batch, res)


def scenario_old_first_update(spec, res):
    """pi_old without the first mini-batch's rows (Trainer.set_old_logprobs) and an RL step on it; beside
    a fresh trainer given pi_old of every row: the old log-probs, the rows the no-grad forward saw,
    the step's metrics and weights."""
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.build import RunBuilder
    from megaforge.data.batch import set_denominators, share_of
    from megaforge.trainer.megatron import MegatronTrainer

    batch = set_denominators(make_batch(B=8, lengths=(20, 7, 13, 3, 17, 9, 15, 5)).replace(old_logprobs=None))
    cfg = trainer_cfg(spec["model"], layout=spec["layout"], mini_batches=2)
    out = {}
    for name in ("skip", "every_row"):
        tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
        share = share_of(batch, 2, *tr.data_parallel())
        seen = []
        compute = tr.compute_logprobs
        tr.compute_logprobs = lambda b, *a, **k: seen.append(b.batch_size) or compute(b, *a, **k)  # noqa: E731
        tr.set_old_logprobs(share, every_row=name == "every_row")
        tr.compute_logprobs = compute
        out[name] = {"old": share.old_logprobs.clone(), "flag": share.old_from_first_update, "seen": seen,
                     "rows": share.batch_size, "first_rows": share.minis[0].hi, "metrics": tr.train_step(share)}
        out[name]["weights"], _ = hf_weights(tr, 1 << 30)
        tr.close()
    res.update(out)


def scenario_warm_up_cuda(spec, res):
    """On CUDA in bfloat16: torch.compile graphs made by a cold trainer's first RL step (its pi_old
    pass and update); then, dynamo's caches cleared, a new trainer's warm-up and the graphs its first
    RL step still makes (tests/gpu/test_warm_up_cuda.py)."""
    import torch
    from torch._dynamo.utils import counters
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch = make_batch(B=5, T=40, lengths=(40, 17, 33, 9, 27))  # micro-batches of 2 rows: other lengths each
    cfg = trainer_cfg(spec["model"], dtype="bfloat16", device="cuda", micro_batch_size=2, lr=1e-4)

    def graphs() -> int:
        return counters["stats"]["unique_graphs"]

    def first_step(tr) -> int:
        g = graphs()
        batch.old_logprobs = tr.compute_logprobs(batch, positions="trained")
        res.setdefault("metrics", []).append(run_steps(tr, batch, ["rl"])[0])
        return graphs() - g

    cold = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    res["cold_step_graphs"] = first_step(cold)
    cold.close()
    del cold
    torch._dynamo.reset()
    warm = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    g, t0 = graphs(), time.perf_counter()
    warm.warm_up()
    torch.cuda.synchronize()
    res["warm_up_s"], res["warm_up_graphs"] = time.perf_counter() - t0, graphs() - g
    res["warm_step_graphs"] = first_step(warm)
    warm.close()


def scenario_opt_state(spec, res):
    import torch

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer
    from megaforge.trainer.megatron import checkpoint as ck

    tr = MegatronTrainer(RunBuilder(trainer_cfg(spec["model"], layout=spec["layout"])).trainer_spec())
    run_steps(tr, make_batch(), ["rl", "rl"])  # Adam's moments away from zero
    ours = ck._sharded(tr, with_optimizer=True, with_ref=False, loading=False)["optimizer"]
    md = dict(ck._OPT_METADATA)
    theirs = tr.optimizer.sharded_state_dict(ck.model_sharded_state_dict(tr.bm, None, md), is_loading=False,
                                             metadata=md)

    def entries(sd):
        return {(v.key, v.global_offset): v for v in nested_values(sd) if isinstance(v, ShardedTensor)}

    a, b = entries(ours), entries(theirs)
    own = set()  # storages of the optimizer's own main params and moments
    for inner in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                own.add(p.untyped_storage().data_ptr())
                own.update(t.untyped_storage().data_ptr() for t in inner.optimizer.state[p].values()
                           if torch.is_tensor(t) and t.dim())
    diffs = [f"{k}: only in one" for k in set(a) ^ set(b)]
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        for f in ("global_shape", "local_shape", "dtype", "replica_id", "axis_fragmentations"):
            if getattr(x, f) != getattr(y, f):
                diffs.append(f"{k}: {f} {getattr(x, f)} != {getattr(y, f)}")
        if not torch.equal(x.data, y.data):
            diffs.append(f"{k}: values differ")
    res["optimizer_keys"] = sorted({k[0].split(".")[2] for k in a if k[0].startswith("optimizer.state.")})
    res["diffs"] = diffs
    res["ours_own_storage"] = sum(v.data.untyped_storage().data_ptr() in own for v in a.values())
    res["theirs_own_storage"] = sum(v.data.untyped_storage().data_ptr() in own for v in b.values())
    res["optimizer_entries"] = sum(k[0].startswith("optimizer.state.") for k in a)
    tr.close()


def scenario_te_cuda(spec, res):
    from mt_helpers import make_batch, trainer_cfg
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch = make_batch(B=5, T=40, lengths=(40, 17, 33, 9, 27))
    kw = dict(device=spec.get("device", "cuda"), micro_batch_size=batch.batch_size, lr=spec.get("lr", 1e-4))
    ref = MegatronTrainer(RunBuilder(trainer_cfg(spec["model"], dtype="bfloat16", layer_spec="torch", **kw)).trainer_spec())
    res["torch_lp0"] = ref.compute_logprobs(batch)
    ref.close()
    del ref
    if spec.get("moe_sequential"):  # MoE: the TE spec's experts as SequentialMLP, beside the grouped GEMM below
        seq = MegatronTrainer(RunBuilder(trainer_cfg(spec["model"], dtype="bfloat16", layer_spec="te", moe_experts="sequential", **kw)).trainer_spec())
        res["seq_lp0"] = seq.compute_logprobs(batch)
        res["seq_names"] = sorted(n for n, _ in seq.bm.model.named_parameters())
        seq.close()
        del seq
    cfg = trainer_cfg(spec["model"], dtype="bfloat16", layer_spec=spec.get("layer_spec", "te"), fp8=spec.get("fp8"), **kw)
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    res["spec"] = tr.spec
    res["names"] = sorted(n for n, _ in tr.bm.model.named_parameters())
    res["w0"], _ = hf_weights(tr, 1 << 30)
    res["lp0_first"] = tr.compute_logprobs(batch)  # FP8: scales from an empty amax history
    res["lp0"] = tr.compute_logprobs(batch)  # FP8: scales from the first forward's amax
    res["metrics"] = run_steps(tr, batch, ["rl", "rl"])
    res["w1"], _ = hf_weights(tr, 1 << 30)
    res["lp1"] = tr.compute_logprobs(batch)
    tr.save(spec["ckpt"])
    tr.close()
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    if spec.get("fp8"):  # FP8 delayed scaling's state is a pickle: refused unless checkpoint.trust_te_pickle
        from megaforge.trainer.megatron.checkpoint import UntrustedCheckpointState

        try:
            tr.load(spec["ckpt"])
            res["untrusted_load"] = "loaded"
        except UntrustedCheckpointState as e:
            res["untrusted_load"] = str(e)
        tr.close()
        cfg.checkpoint.trust_te_pickle = True
        tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    tr.load(spec["ckpt"])
    res["w2"], _ = hf_weights(tr, 1 << 30)
    res["lp2"] = tr.compute_logprobs(batch)
    res["metrics2"] = run_steps(tr, batch, ["rl"])
    tr.export_hf(spec["export"])
    res["w3"], _ = hf_weights(tr, 1 << 30)
    tr.close()


def main():
    from mt_helpers import worker_main

    worker_main({"logprobs": scenario_logprobs, "train": scenario_train, "critic": scenario_critic,
     "reset": scenario_reset, "opt_state": scenario_opt_state, "te_cuda": scenario_te_cuda,
     "warm_up": scenario_warm_up, "warm_up_cuda": scenario_warm_up_cuda,
     "old_first_update": scenario_old_first_update})


if __name__ == "__main__":
    main()
