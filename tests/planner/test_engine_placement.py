"""Issue 42: engine GPU placement is computed once (megaforge.planner.layout.engine_gpus). The run's
single-node assignment (megaforge.rollout.http.start.gpu_assignment) is the placement the dry-run
planner reports, for every layout that fits one node."""
import itertools

import pytest

from megaforge.planner.layout import Hardware, Layout, engine_gpus, placement
from megaforge.rollout.http.start import gpu_assignment


def planned(num_engines, tp, num_gpus, local_world, gpus):
    """{engine id: [GPU of TP rank 0, 1, ...]} from the planner's placement rows of one node."""
    lay = Layout("torch", local_world, 1, 1, 1, local_world, 1, 1, local_world, False, "hf", "sglang", tp, num_engines,
                 num_gpus == 0, num_gpus)
    found: dict = {}
    for row in placement(lay, Hardware(1, gpus, "test", 80.0)):
        if "engine" in row:
            found.setdefault(row["engine"]["id"], []).append((row["engine"]["tp_rank"], row["gpu"]))
    return [[g for _, g in sorted(found[k])] for k in sorted(found)]


def test_the_run_assigns_the_gpus_the_planner_reports():
    checked = 0
    for num_engines, tp, num_gpus, local_world, gpus in itertools.product((1, 2, 3, 4), (1, 2, 4), (0, 2, 4, 6),
                                                                          (1, 2, 4), (2, 4, 8)):
        visible = list(range(10, 10 + gpus))  # CUDA_VISIBLE_DEVICES ids: mapped, not positions
        try:
            got = gpu_assignment(num_engines, tp, num_gpus, local_world, visible)
        except ValueError:
            continue  # a layout the node cannot hold (tests/rollout/http/test_processes.py: its messages)
        want = planned(num_engines, tp, num_gpus, local_world, gpus)
        assert got == [[visible[g] for g in e] for e in want], (num_engines, tp, num_gpus, local_world, gpus)
        checked += 1
    assert checked > 50  # colocated and disaggregated layouts, several engines and TP sizes


@pytest.mark.parametrize("args,expected", [
    ((2, 2, 0, 2, 2), [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]),  # colocated: node-major over all GPUs
    ((2, 1, 4, 2, 4), [[(0, 2)], [(0, 3)]]),                  # disaggregated: each node's last 2 GPUs
    ((1, 2, 4, 2, 4), [[(0, 2), (0, 3)]]),
    ((3, 2, 0, 1, 4), [[(0, 0), (0, 1)], [(0, 2), (0, 3)], []]),  # beyond the GPUs: none (check_layout says so)
])
def test_engine_gpus(args, expected):
    assert engine_gpus(*args) == expected
