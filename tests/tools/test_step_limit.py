"""tools/bench/step_limit.py: our estimate of the fastest a GRPO step's batch could run on one GPU,
checked term by term against the formulas of its docstring worked by hand (the tool prints 4
significant digits: the comparison is to 1e-3 relative)."""
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools", "bench"))
from step_limit import hardware, step_limit  # noqa: E402

# a Llama-layout shape: h 64, F 128, L 2, V 100, 4 heads of 16, 2 KV heads
HF = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=100,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="llama")


def test_each_term_by_hand():
    P = 2 * (64 * 16 * (4 + 2 * 2) + 4 * 16 * 64 + 2 * 64) + 2 * 3 * 64 * 128 + 2 * 100 * 64 + 64
    prompts, responses = [10, 10, 30, 30], [5, 20, 1, 4]
    rows = [15, 30, 31, 34]
    F = 6 * P * sum(rows) + 6 * 2 * 64 * sum(r * r for r in rows)
    F_prompts = 6 * P * (10 + 30) + 6 * 2 * 64 * (10 * 10 + 30 * 30)  # groups of 2 share a prompt
    C, B = 1e12, 1e9
    kv = 2 * 2 * 2 * 16 * 2
    decode = 20 * 2 * P + kv * sum(o * p + o * (o - 1) // 2 for p, o in zip(prompts, responses))
    got = step_limit(HF, prompts, responses, group=2, passes=2, peak=C, bandwidth=B, frac=0.5)
    want = {"train_s": F / (0.5 * C), "forward_s": 2 * F / 3 / (0.5 * C), "prefill_s": F_prompts / 3 / (0.5 * C),
            "decode_s": decode / B}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-3), k
    total = sum(want.values())
    assert got["tokens"] == sum(rows)
    assert got["tokens_per_s"] == pytest.approx(sum(rows) / total, rel=1e-3)


def test_known_gpus_and_bad_input():
    assert hardware("NVIDIA H200") == (989.4e12, 4.8e12)
    assert hardware("NVIDIA H100 80GB HBM3") == (989.4e12, 3.35e12)
    assert hardware("NVIDIA H100 PCIe") is None and hardware("cpu") is None
    with pytest.raises(ValueError, match="2 prompts, 1 responses"):
        step_limit(HF, [1, 2], [3], 1, 1, 1.0, 1.0)
