"""Writes a real megatron-core dist checkpoint (torch_dist: .metadata, .distcp shards, common.pt) in one
gloo rank on CPU: ``python mcore_ckpt.py DIR``."""
import os
import queue
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    from megaforge.trainer.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()  # synchronous save, as megaforge's backend does
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.randn(4, 3)),
          "b": ShardedTensor.from_rank_offsets("b", torch.randn(3).to(torch.bfloat16)),
          "opt": ShardedObject("opt", {"step": 3, "lr": 0.1}, (1,), (0,), replica_id=0),
          "iteration": 5, "args": {"name": "x"}}
    os.makedirs(sys.argv[1], exist_ok=True)
    dist_checkpointing.save(sd, sys.argv[1], sharded_strategy=("torch_dist", 1))
    dist.destroy_process_group()
