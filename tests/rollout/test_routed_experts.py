"""Routed experts from the rollout engines (megaforge.rollout.routing): SGLang's wire format, the
embedded engine's own routing against an HF forward's router top-k, the embedded server over HTTP
(the client that also talks to SGLang), and the boundary checks naming the sample."""
from __future__ import annotations

import base64
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))

from megaforge.rollout import routing  # noqa: E402
from megaforge.rollout.routing import RoutingError, RoutingShape  # noqa: E402
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 17, 33, 9], [100, 101], [7, 8, 9, 10, 11, 12, 13]]


def sglang_text(arr: np.ndarray) -> str:
    """What sglang 0.5.16's detokenizer sends: pybase64.b64encode(tensor.numpy().tobytes()) of int32."""
    return base64.b64encode(arr.astype(np.int32).tobytes()).decode("utf-8")


def test_decode_reads_sglang_wire_format_and_refuses_malformed_text():
    arr = np.arange(5 * 4 * 2, dtype=np.int32).reshape(5, 4, 2) % 4
    t = routing.decode(sglang_text(arr), 5, "req r0")
    assert t.dtype == torch.int32 and t.shape == (5, 8) and torch.equal(t.view(5, 4, 2), torch.from_numpy(arr))
    with pytest.raises(RoutingError, match="req r0.*not a whole row for each of the 6 tokens"):
        routing.decode(sglang_text(arr), 6, "req r0")
    with pytest.raises(RoutingError, match="not base64"):
        routing.decode("@@@", 5, "req r0")
    with pytest.raises(RoutingError, match="--enable-return-routed-experts"):
        routing.decode(None, 5, "req r0")
    assert routing.encode(torch.from_numpy(arr)) == sglang_text(arr)


def test_check_names_the_sample_for_wrong_shape_ids_and_duplicates():
    shape = RoutingShape(layers=3, topk=2, num_experts=4, moe_layers=(False, True, True))
    good = torch.tensor([[[0, 0], [1, 3], [2, 0]]] * 4, dtype=torch.int32)
    out = routing.check(good.view(4, 6), 4, shape, "sample 3")
    assert out.dtype == routing.DTYPE and out.shape == (4, 3, 2)
    with pytest.raises(RoutingError, match=r"sample 3: routed experts of shape \(5, 3, 2\), expected \[4 tokens"):
        routing.check(torch.cat([good, good[:1]]), 4, shape, "sample 3")
    bad = good.clone()
    bad[2, 1, 0] = 4
    with pytest.raises(RoutingError, match="sample 3: routed expert ids in \\[0, 4\\], the model has 4 experts"):
        routing.check(bad, 4, shape, "sample 3")
    dup = good.clone()
    dup[0, 2] = torch.tensor([1, 1])
    with pytest.raises(RoutingError, match="same expert twice"):
        routing.check(dup, 4, shape, "sample 3")
    with pytest.raises(RoutingError, match="no routed experts"):
        routing.check(None, 4, shape, "sample 3")
    with pytest.raises(RoutingError, match="integer"):
        routing.check(good.float(), 4, shape, "sample 3")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from test_routing_replay import make_moe

    return make_moe(str(tmp_path_factory.mktemp("moe") / "m"))


def hf_topk(model, ids: list[int]) -> torch.Tensor:
    """[n, layers, K] the HF model's router top-k of each of ``ids`` (one unpadded forward), dense 0."""
    layers = model.model.layers
    out = torch.zeros((len(ids), len(layers), 2), dtype=torch.int32)
    with torch.no_grad():
        h = {}
        hooks = [ly.mlp.gate.register_forward_hook(lambda m, i, o, li=li: h.__setitem__(li, o[2]))
                 for li, ly in enumerate(layers) if hasattr(ly.mlp, "experts")]
        model(torch.tensor([ids]))
        for x in hooks:
            x.remove()
    for li, v in h.items():
        out[:, li] = v.view(len(ids), 2).to(torch.int32)
    return out


def _requests(routed=True):
    from megaforge.types import GenerateRequest, SamplingParams

    return [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=6 + i, stop_token_ids=[2], seed=3 + i),
                            rid=f"r{i}", return_routed_experts=routed) for i, p in enumerate(PROMPTS)]


def _check_against_hf(model, comps):
    for p, c in zip(PROMPTS, comps):
        seq = p + c.output_ids
        table = c.routed_experts.view(len(seq) - 1, -1, 2)
        want = hf_topk(model, seq[:-1])
        # the engine (left-padded batch, KV cache) against one HF forward: the same top-k sets (order aside)
        assert torch.equal(table.sort(-1).values, want.sort(-1).values), (c.rid, table, want)
        assert (table[:, 0] == 0).all()  # layer 0 is dense: 0s, as sglang


def test_embedded_engine_reports_its_routing_like_an_hf_forward(moe_dir):
    import transformers

    from megaforge.rollout.embedded.engine import EmbeddedEngine

    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    eng = EmbeddedEngine(model, fast="off")
    comps = eng.generate(_requests())
    _check_against_hf(model, comps)
    assert all(c.routed_experts is None for c in eng.generate(_requests(routed=False)))


def test_embedded_server_sends_routing_in_sglang_format_through_the_http_client(moe_dir, tmp_path, tokenizer):
    import transformers
    from engine_helpers import engine_config

    from megaforge.rollout import build_engine
    from megaforge.rollout.manager import completions_to_samples

    eng = build_engine(RunBuilder(engine_config(tmp_path, moe_dir)).engine_spec(), tokenizer)
    try:
        comps = eng.generate(_requests())
        model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
        _check_against_hf(model, comps)
        assert all(c.routed_experts.dtype == torch.int32 for c in comps)
        # the boundary: a table one token short names the sample
        shape = routing.routing_shape(model.config)
        rows = [type("Row", (), {"prompt_ids": p, "prompt_text": "", "label": None})() for p in PROMPTS]
        samples = completions_to_samples(rows, 1, comps, tokenizer, routing_shape=shape)
        assert [tuple(s.routed_experts.shape) for s in samples] == [
            (len(p) + len(c.output_ids) - 1, 4, 2) for p, c in zip(PROMPTS, comps)]
        comps[1].routed_experts = comps[1].routed_experts[:-1]
        with pytest.raises(RoutingError, match=r"sample 1 \(request r1, group 1\): routed experts of shape"):
            completions_to_samples(rows, 1, comps, tokenizer, routing_shape=shape)
    finally:
        eng.shutdown()
