"""One rank of the two-node engine start test (test_engine_kinds.py): a job of 2 nodes x 1 trainer rank
(gloo, CPU) starts the engines of a toy kind that is not in-process through
megaforge.placement.build_engines; the toy kind's build records what its node got and hands the node
stand-in servers (URLs only: nothing listens) to gather. Writes this rank's findings as JSON."""
import json
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from megaforge.engine_kinds import ENGINE_KINDS, EngineKind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALLS: list = []
SERVERS: list = []


class StandInServer:
    def __init__(self, k: int):
        self.port = 9000 + k
        self.url = f"http://127.0.0.1:{self.port}"
        self.stopped = False

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopped = True


def build(spec, tokenizer, node=None):
    key = node.share(f"key-of-rank-{dist.get_rank()}")
    servers = [StandInServer(k) for k in node.engine_ids]
    SERVERS.extend(servers)
    CALLS.append({"key": key, "engine_ids": node.engine_ids, "gpus": node.gpus})
    return node.gather(servers)


ENGINE_KINDS.register("toy_remote", EngineKind(build=build))


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    from megaforge.cluster import Job
    from megaforge.config import load_config
    from megaforge.build import RunBuilder

    cfg = load_config(["--config", os.path.join(ROOT, "configs", "demo_cpu.yaml"), "--rollout.engine", "toy_remote",
                       "--rollout.num_engines", "2", "--rollout.num_gpus", "2"])
    job = Job()
    got = RunBuilder(cfg).engines(None, job)  # the planner's placement over the 2 nodes, the toy kind's build
    job.end(together=True)
    with open(out, "w") as f:
        json.dump({"engine": got, "calls": CALLS, "stopped": [s.stopped for s in SERVERS]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
