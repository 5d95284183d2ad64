"""One rank of the Megatron offload test (launched by test_megatron_offload.py through mt_helpers.run_ranks).

    python mt_offload_worker.py MODEL_DIR OUT_DIR

For model dtype float32 and bfloat16 (fp32 main parameters in the optimizer), with the distributed
optimizer: a resident trainer and one whose DDP buffers, optimizer state and reference model go
through the copy engine (CPU-emulated) between three RL steps (policy and PPO critic), in the
loop's order. Records, per
variant: HF weights and metrics after the steps, and the checks of every offload/onload (storages
freed, identities kept, values restored, gradient buffers zero, host buffers not re-allocated).
"""
from __future__ import annotations

import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))


def nbytes(t):
    return t.untyped_storage().nbytes()


def run(model_dir: str, dtype: str, offload: bool) -> dict:
    from mt_helpers import make_batch, trainer_cfg

    from megaforge.memory.offload import PinnedOffloader
    from megaforge.memory.state import megatron_parts
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    cfg = trainer_cfg(model_dir, layout={"dist_opt": True})
    cfg.model.dtype = dtype
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    tr.snapshot_reference()
    tr.init_critic()  # its DDP buffers and optimizer are trainer state too
    if offload:
        tr._mem = PinnedOffloader(tr.offload_entries, "cpu", chunk_bytes=64 << 10)
    batch = make_batch()
    returns = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    out = {"metrics": [], "checks": {}, "host_allocs": []}
    ck = out["checks"]
    for step in range(3):
        tr.onload()
        b = copy.deepcopy(batch)
        b.ref_logprobs = tr.compute_logprobs(b, "ref")
        b.values, b.returns = tr.compute_values(b), returns
        out["metrics"].append(tr.train_step(b))
        if not offload:
            continue
        ents = tr.offload_entries(("weights", "state"))
        ck["kinds"] = sorted({(e.tag, e.keep, e.movable) for e in ents})
        group_params = {id(p) for o in megatron_parts(tr.optimizer) for g in o.optimizer.param_groups
                        for p in g["params"]}
        ck["main_params"] = sum(1 for e in ents if e.tag == "state" and id(e.tensor) in group_params)
        vals = {id(e.tensor): (e, e.tensor.detach().clone()) for e in ents}
        pids = [id(p) for m in (tr.ddp, tr.ref, tr.critic.ddp) for p in m.parameters()]
        tr.offload(["state"])
        ck.setdefault("state_freed", []).append(all(nbytes(e.tensor) == 0 for e in ents if e.tag == "state"))
        ck.setdefault("weights_kept", []).append(all(nbytes(e.tensor) > 0 for e in ents if e.tag == "weights"))
        ck.setdefault("hf_while_state_out", []).append(sum(len(bk) for bk in tr.iter_hf_buckets(1 << 20)))
        tr.offload(["weights"])
        ck.setdefault("all_freed", []).append(all(nbytes(p) == 0 for p in tr.ddp.parameters())
                                              and all(nbytes(e.tensor) == 0 for e in ents))
        tr.onload()
        ck.setdefault("ids", []).append(pids == [id(p) for m in (tr.ddp, tr.ref, tr.critic.ddp) for p in m.parameters()])
        ok = True
        for e, v in vals.values():
            ok &= torch.equal(e.tensor, v) if e.keep else bool((e.tensor == 0).all())
        ck.setdefault("values", []).append(ok)
        tr.offload()  # as after the loop's sync: everything out until the next step
        out["host_allocs"].append(tr._mem.stats["host_allocs"])
    tr.onload()
    out["critic_values"] = tr.compute_values(batch)
    out["weights"] = {n: t.detach().float().cpu().clone() for bk in tr.iter_hf_buckets(1 << 30) for n, t in bk}
    tr.close()
    return out


def main():
    model_dir, outdir = sys.argv[1:3]
    res = {}
    for dtype in ("float32", "bfloat16"):
        for offload in (False, True):
            res[(dtype, offload)] = run(model_dir, dtype, offload)
    from mt_helpers import save_rank_result

    save_rank_result(res, outdir, "offload")


if __name__ == "__main__":
    main()
