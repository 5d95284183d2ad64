"""tools/bench/bench_train.py with raw megatron-core's step running out of device memory (a test driver).

    python bench_raw_oom.py ARGS...   # ARGS: bench_train's

The CPU cannot run out of CUDA memory, so raw's step raises the error PyTorch raises there (``torch.OutOfMemoryError``,
its message's first line as on the H100 of 2026-12-07, where raw's step at q17b with 16,384-token micro-batches
failed this way); the tool's own path does the rest: report raw's error, still time ours.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "bench"))

import torch  # noqa: E402

import bench_train  # noqa: E402


def raw_step_out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB. GPU 0 has a total capacity of 79.18 GiB"
                                 " of which 6.41 GiB is free.\n(the rest of PyTorch's message)")


if __name__ == "__main__":
    bench_train.raw_step = raw_step_out_of_memory
    sys.exit(bench_train.main(sys.argv[1:]))
