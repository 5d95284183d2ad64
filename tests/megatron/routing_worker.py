"""One rank of the routing-replay tests (tests/megatron/test_routing_replay.py), launched by
mt_helpers.run_workers: ``python routing_worker.py replay SPEC.json OUTDIR``.

At one layout: logprobs without a routing, with the model's own routing (recorded by HF) and with a
different one; per pass the fraction of replayed choices the router would have made otherwise and the
number of (token, layer) rows whose dispatched experts (megatron's routing_map) differ from the
replayed ones; then an RL train step with the own routing (its routing/replay_diff_frac).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def scenario_replay(spec, res):
    import torch
    import torch.distributed as dist

    from mt_helpers import trainer_cfg
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer
    from megaforge.trainer.megatron import routing_replay as rr

    data = torch.load(spec["batch"], weights_only=False)
    batch = data["batch"]
    tr = MegatronTrainer(RunBuilder(trainer_cfg(spec["model"], layout=spec["layout"], micro_batch_size=2,
                                     expert_parallel=spec["layout"].get("ep", 1))).trainer_spec())
    wrong = torch.zeros(1)

    def check_map(module, _inp, out):  # the experts megatron dispatched to == the replayed ones
        r = module.router_replay
        if isinstance(r, rr.ReplayRouter) and r.routes is not None and r.replay:
            rmap = out[1]
            want = torch.zeros_like(rmap).scatter(1, r.routes, True)
            wrong.add_(float((rmap[r.valid] != want[r.valid]).any(-1).sum()))

    hooks = [m.register_forward_hook(check_map) for m in rr.routers(tr.ddp)]

    def run(routes):
        rr.reset_stats(tr.ddp)
        wrong.zero_()
        lp = tr.compute_logprobs(batch.replace(routed_experts=routes))
        c = rr.diff_counts(tr.ddp, tr.device)
        dist.all_reduce(c)
        w = wrong.clone()
        dist.all_reduce(w)
        return lp, float(c[0] / c[1]) if float(c[1]) else -1.0, float(w)

    res["plain"], _, _ = run(None)
    res["own"], res["own_diff"], res["own_wrong"] = run(data["own"])
    res["other"], res["other_diff"], res["other_wrong"] = run(data["other"])
    res["plain_again"], _, _ = run(None)  # a pass without a routing after one with: the routers choose again
    for h in hooks:
        h.remove()
    res["step"] = tr.train_step(batch.replace(routed_experts=data["own"]))
    tr.close()


def main():
    from mt_helpers import worker_main

    worker_main({"replay": scenario_replay})


if __name__ == "__main__":
    main()
