"""HF <-> Megatron layouts and family tables: pure, single-process checks."""
import pytest
import torch

from megaforge.convert import families, layouts, mapping
from megaforge.convert.layouts import Dims


def _dims(nq=4, nkv=2, hd=3, h=6, f=8, v=11, vp=16):
    return Dims(hidden=h, num_heads=nq, num_kv_heads=nkv, head_dim=hd, ffn=f, vocab=v, padded_vocab=vp)


def test_fused_qkv_is_grouped_q_then_k_then_v():
    d = _dims()
    q = torch.arange(12.)[:, None] + 100  # 4 heads x hd 3
    k = torch.arange(6.)[:, None] + 200
    v = torch.arange(6.)[:, None] + 300
    m = layouts.fuse_qkv(q, k, v, d)[:, 0]
    # group 0: q heads 0,1 | k head 0 | v head 0 ; group 1: q heads 2,3 | k 1 | v 1
    expect = torch.cat([q[:6, 0], k[:3, 0], v[:3, 0], q[6:, 0], k[3:, 0], v[3:, 0]])
    assert torch.equal(m, expect)


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_every_layout_bit_identical(tp):
    d = _dims()
    g = torch.Generator().manual_seed(0)
    cases = {
        "qkv": [torch.randn(12, 6, generator=g), torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)],
        "gate_up": [torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)],
        "vocab": [torch.randn(11, 6, generator=g)],
        "row": [torch.randn(6, 12, generator=g)],
        "column": [torch.randn(8, 6, generator=g)],
        "replicated": [torch.randn(6, generator=g)],
    }
    for name, hf in cases.items():
        lay = layouts.get_layout(name)
        full = lay.to_megatron(hf, d)
        shards = [lay.shard(full, tp, r, d) for r in range(tp)]
        back = lay.to_hf(lay.merge(shards, d), d)
        assert len(back) == len(hf)
        for a, b in zip(hf, back):
            assert torch.equal(a, b), name
        assert [tuple(x.shape) for x in hf] == lay.hf_shapes(lay.full_shape(shards[0].shape, tp), d)


def test_gate_up_shard_holds_matching_halves():
    d = _dims()
    gate, up = torch.arange(8.)[:, None], torch.arange(8.)[:, None] + 50
    full = layouts.get_layout("gate_up").to_megatron([gate, up], d)
    s1 = layouts.get_layout("gate_up").shard(full, 2, 1, d)[:, 0]
    assert s1.tolist() == [4, 5, 6, 7, 54, 55, 56, 57]


def test_vocab_padding_rule_and_errors():
    assert layouts.padded_vocab_size(11, 4, 2) == 16
    assert layouts.padded_vocab_size(16, 4, 2) == 16
    d = _dims()
    with pytest.raises(ValueError, match="rows, config vocab_size is 11"):
        layouts.pad_vocab(torch.zeros(12, 6), d)
    with pytest.raises(ValueError, match=r"HF k has shape \(5, 6\), expected \(6, 6\)"):
        layouts.fuse_qkv(torch.zeros(12, 6), torch.zeros(5, 6), torch.zeros(6, 6), d)
    with pytest.raises(ValueError, match="num_kv_heads=2 is not divisible by tp=4"):
        layouts.get_layout("qkv").shard(torch.zeros(24, 6), 4, 0, d)


def _hf_config(kind, tied=False):
    import transformers

    kw = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    if kind == "qwen3":
        kw["head_dim"] = 8
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config}[kind](**kw)


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_family_tables_cover_hf_model_and_round_trip(kind, tied):
    import transformers

    cfg = _hf_config(kind, tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fam = families.family_of(cfg)
    desc = fam.describe(cfg)
    d = desc.dims(desc.padded_vocab(8, 2))
    maps = fam.param_maps(desc)
    exported = [n for pm in maps if pm.export for n in pm.hf]
    assert len(exported) == len(set(exported))
    expected = set(sd) - ({"lm_head.weight"} if tied else set())
    assert set(exported) == expected
    src = mapping.HFSource(state_dict=sd)
    for pm in maps:
        shards = [mapping.to_megatron_shard(pm, src, d, 2, r) for r in range(2)]
        for name, t in mapping.to_hf(pm, shards, d):
            assert torch.equal(t, sd[name]), (pm.megatron, name)


def test_unknown_family_is_named():
    import transformers

    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        families.family_of(transformers.GPT2Config())
