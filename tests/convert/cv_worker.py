"""One rank of a multi-process conversion test (launched by cv_helpers.run_worker).

    python cv_worker.py SCENARIO SPEC.json OUTDIR

Scenario ``roundtrip`` (spec keys ``runs``, ``errors``, ``trainer``):

* ``runs``: for each (name, HF dir, layout, [export layouts]): HF -> dist checkpoint at ``layout``
  (:func:`hf_to_megatron`); then for each export layout: open the checkpoint at that layout, stream
  :func:`iter_hf_buckets` with a small limit (buckets recorded), export through :func:`export_hf`
  with small shards (``model.safetensors.index.json``), optionally with a dtype cast.
* ``errors``: conversions that must fail (message recorded, leftovers listed).
* ``trainer``: a MegatronTrainer at a layout loads a converted checkpoint, computes logprobs of a
  fixed batch, streams and exports its weights, then takes one RL step (metrics, new weights),
  saves a training checkpoint (optimizer, reference) and converts that to HF at another layout.

Results go to OUTDIR/SCENARIO.rank{R}.pt.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))
warnings.filterwarnings("ignore")


def lay(d: dict):
    from megaforge.convert.ranks import Layout

    return Layout(d.get("tp", 1), d.get("pp", 1), d.get("ep", 1), d.get("etp"))


def lay_name(d: dict) -> str:
    return "_".join(f"{k}{v}" for k, v in sorted(d.items()))


def stream(bm, max_bytes: int) -> dict:
    from megaforge.trainer.megatron.hf_export import iter_hf_buckets

    buckets = []
    for b in iter_hf_buckets(bm, max_bytes):
        buckets.append([(n, t.detach().cpu().clone()) for n, t in b])
    return {"buckets": buckets, "limit": max_bytes}


def scenario_roundtrip(spec, res, outdir):
    import torch.distributed as dist

    from megaforge.convert.hf_writer import leftovers
    from megaforge.trainer.megatron.convert import hf_to_megatron, open_checkpoint
    from megaforge.trainer.megatron.hf_export import export_hf

    timings = res.setdefault("timings", {})
    for name, hf_dir, layout, exports in spec["runs"]:
        ckpt = os.path.join(outdir, f"ckpt_{name}")
        t0 = time.time()
        hf_to_megatron(hf_dir, ckpt, lay(layout))
        timings[f"{name} hf->megatron {lay_name(layout)}"] = time.time() - t0
        for ex in exports:
            t0 = time.time()
            bm, cfg, cfg_dir = open_checkpoint(ckpt, None, lay(ex["layout"]) if ex.get("layout") else None)
            key = (name, lay_name(ex.get("layout", {})), ex.get("dtype"))
            res[key] = {"stream": stream(bm, ex["bucket_bytes"])}
            out = os.path.join(outdir, f"hf_{name}_{lay_name(ex.get('layout', {}))}_{ex.get('dtype')}")
            export_hf(bm, cfg, out, None, cfg_dir, max_shard_bytes=ex["shard_bytes"], bucket_bytes=ex["bucket_bytes"],
                      dtype=getattr(torch, ex["dtype"]) if ex.get("dtype") else None)
            res[key]["out"] = out
            timings[f"{name} megatron->hf {lay_name(ex.get('layout', {}))}"] = time.time() - t0
    if spec.get("te_copy"):  # the MoE checkpoint re-keyed as the TE layer spec writes it, read back
        from megaforge.trainer.megatron import checkpoint as mckpt

        src, dst = spec["te_copy"]
        bm, cfg, cfg_dir = open_checkpoint(src)
        meta = dict(mckpt.read_meta(src), layer_spec="te")
        mckpt.write_sharded({"model": mckpt.model_sharded_state_dict(bm, "te")}, dst, meta, cfg, None, cfg_dir)
        bm, _, _ = open_checkpoint(dst)
        res["te_stream"] = stream(bm, 1 << 30)
    if spec.get("break_ckpt"):  # a copy of a checkpoint with one data file removed
        src, dst = spec["break_ckpt"]
        if dist.get_rank() == 0:
            import shutil

            shutil.copytree(src, dst)
            os.remove(os.path.join(dst, "__1_0.distcp"))
        dist.barrier()
    for case in spec.get("errors", []):
        t0 = time.time()
        try:
            if case["kind"] == "hf_to_megatron":
                hf_to_megatron(case["hf"], case["out"], lay(case.get("layout", {})))
            else:
                from megaforge.trainer.megatron.convert import megatron_to_hf

                megatron_to_hf(case["ckpt"], case["out"], case.get("hf_config"),
                               layout=lay(case["layout"]) if case.get("layout") else None)
            msg = None
        except Exception as e:  # noqa: BLE001 - the message is the result
            msg = f"{type(e).__name__}: {e}"
        dist.barrier()
        res[("error", case["name"])] = {"msg": msg, "exists": os.path.exists(case["out"]),
                                        "leftovers": leftovers(case["out"])}
        timings[f"error {case['name']}"] = time.time() - t0
    if spec.get("trainer"):
        scenario_trainer(spec["trainer"], res, outdir)


SHARD = 60_000


def scenario_trainer(spec, res, outdir):
    from mt_helpers import make_batch, trainer_cfg

    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    t0 = time.time()
    batch = make_batch(vocab=spec["vocab"])
    layout = spec["layout"]
    cfg = trainer_cfg(spec["model"], layout=layout, micro_batch_size=batch.batch_size)
    cfg.trainer.expert_parallel = layout.get("ep", 1)
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    tr.load(spec["ckpt"])
    res["trainer_lp"] = tr.compute_logprobs(batch)
    res["trainer_stream"] = stream(tr.bm, spec["bucket_bytes"])
    tr.export_hf(spec["export"])
    res["trainer_metrics"] = tr.train_step(batch)
    res["trainer_after"] = stream(tr.bm, 1 << 30)
    tr.snapshot_reference()
    tr.save(spec["saved"])  # a training checkpoint: optimizer state and reference model included
    tr.close()
    from megaforge.trainer.megatron.convert import megatron_to_hf

    megatron_to_hf(spec["saved"], spec["saved_export"], layout=lay({"tp": 1, "pp": 2, "ep": 2}), max_shard_bytes=SHARD)
    res["timings"]["trainer"] = time.time() - t0


def main():
    from mt_helpers import worker_main

    worker_main({"roundtrip": scenario_roundtrip})


if __name__ == "__main__":
    main()
