"""One rank of a multi-process MoE (expert parallelism) test, launched by mt_helpers.run_workers.

    python moe_worker.py moe SPEC.json OUTDIR

``moe``: a MegatronTrainer of the MoE model at ``layout`` (tp, pp, ep, etp, sp), micro-batches of 2
rows of the shared 5-row batch: logprobs; one RL step whose reduced gradients (DDP's ``main_grad``
after megatron's finalize, before clipping: the distributed optimizer is off so every rank holds them
whole) are streamed as HF tensors through the converter (``iter_hf_buckets(values=...)``); the
metrics, the HF weights after the step and the logprobs. With ``ckpt``: save, a second step
(weights), then a trainer at ``layout2`` loads the checkpoint: logprobs, the same second step
(weights). Results go to OUTDIR/moe.rank{R}.pt (HF tensors on rank 0 only).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def cfg_at(path: str, layout: dict):
    from mt_helpers import trainer_cfg

    return trainer_cfg(path, layout=layout, micro_batch_size=2, distributed_optimizer=False,
                       expert_parallel=layout.get("ep", 1), expert_tensor_parallel=layout.get("etp", 1))


def hf_of(tr, values=None) -> dict:
    from megaforge.trainer.megatron.hf_export import iter_hf_buckets

    out = {}
    for bucket in iter_hf_buckets(tr.bm, 1 << 30, values):
        for name, t in bucket:
            out[name] = t.detach().cpu().clone()
    return out


def scenario_moe(spec, res):
    from mt_helpers import make_batch
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch = make_batch(vocab=spec["vocab"])
    tr = MegatronTrainer(RunBuilder(cfg_at(spec["model"], spec["layout"])).trainer_spec())
    res["data_parallel"] = tr.data_parallel()
    res["lp"] = tr.compute_logprobs(batch)
    step = tr._clip_and_step

    def grabbing_step():
        grads = {n: p.main_grad.detach().clone() for n, p in tr.bm.model.named_parameters()}
        res["grads"] = hf_of(tr, grads)
        return step()

    tr._clip_and_step = grabbing_step
    res["metrics"] = tr.train_step(batch)
    tr._clip_and_step = step
    res["weights"] = hf_of(tr)
    res["lp_after"] = tr.compute_logprobs(batch)
    if not spec.get("ckpt"):
        tr.close()
        return
    tr.save(spec["ckpt"])
    res["metrics2"] = tr.train_step(batch)
    res["weights2"] = hf_of(tr)
    tr.close()
    tr = MegatronTrainer(RunBuilder(cfg_at(spec["model"], spec["layout2"])).trainer_spec())
    tr.load(spec["ckpt"])
    res["loaded_lp"] = tr.compute_logprobs(batch)
    res["loaded_metrics2"] = tr.train_step(batch)
    res["loaded_weights2"] = hf_of(tr)
    tr.close()


def main():
    from mt_helpers import worker_main

    worker_main({"moe": scenario_moe})


if __name__ == "__main__":
    main()
