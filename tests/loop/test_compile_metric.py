"""``compile/new_graphs`` (megaforge.driver.steps.compiled_graphs): torch.compile graphs made in this
process, counted by dynamo; a step's metric is the difference since the last step's end. On the
CPU demo nothing compiles (0 every step); on CUDA the trainer's warm-up compiles before step 1
(tests/gpu/test_warm_up_cuda.py) and a step that still compiles shows it here."""
import torch

from megaforge.driver.steps import compiled_graphs


def test_compiled_graphs_counts_dynamo_graphs():
    def f(x):
        return torch.sin(x) * 2 + 1

    before = compiled_graphs()
    g = torch.compile(f, backend="eager", dynamic=False)  # a graph per shape, no inductor compile
    g(torch.ones(3))
    g(torch.ones(3))  # cached: no new graph
    assert compiled_graphs() == before + 1
    g(torch.ones(5))
    assert compiled_graphs() == before + 2
