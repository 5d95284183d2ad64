"""One rank of tests/megatron/test_megatron_teacher.py (launched by mt_helpers.run_workers).

    python teacher_worker.py teacher SPEC.json OUTDIR

For every layout in ``layouts``: a MegatronTrainer whose policy is ``student`` and whose distillation
teacher (``teacher.path``) is ``teacher``, another architecture of the same vocabulary; records
compute_logprobs(batch, "teacher") and of the policy, and the teacher's again after the trainer's
warm-up (which runs the teacher's forward too). Results go to OUTDIR/teacher.rank{R}.pt.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    scenario, spec_file, outdir = sys.argv[1:4]
    with open(spec_file) as f:
        spec = json.load(f)
    from mt_helpers import make_batch, save_rank_result, trainer_cfg
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    batch = make_batch()
    res = {}
    for layout in spec["layouts"]:
        cfg = trainer_cfg(spec["student"], layout=layout, micro_batch_size=batch.batch_size)
        cfg.algo.advantage, cfg.teacher.path = "distill", spec["teacher"]
        tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
        key = "_".join(f"{k}{int(v)}" for k, v in sorted(layout.items()))
        res[key] = {"teacher": tr.compute_logprobs(batch, "teacher"), "policy": tr.compute_logprobs(batch, "policy"),
                    "trained": tr.compute_logprobs(batch, "teacher", positions="trained")}
        tr.warm_up()  # scores with the teacher too (its collectives at this layout), and leaves it as it was
        res[key]["teacher_after_warm_up"] = tr.compute_logprobs(batch, "teacher")
        tr.close()
    save_rank_result(res, outdir, scenario)


if __name__ == "__main__":
    main()
