"""Single-process checks: the Qwen3-MoE table, routing settings vs transformers, checkpoint key
renames, the HF writer, the rank launcher."""
import json
import os
import sys

import pytest
import torch

from megaforge.build import RunBuilder
from megaforge.convert import families, mapping
from megaforge.convert.hf_writer import HFWriter, atomic_output_dir, leftovers, parse_size
from megaforge.convert.ranks import Layout, spawn


def test_qwen3_moe_table_covers_the_files_and_round_trips_under_tp_and_etp(tiny_hf):
    """Every tensor of the saved Qwen3-MoE (one tensor per expert on disk) is mapped exactly once;
    HF -> Megatron shards (TP 2 for dense rows, expert-TP 2 for experts) -> HF is bit-identical."""
    import transformers

    path = tiny_hf["qwen3_moe"]
    cfg = transformers.AutoConfig.from_pretrained(path)
    fam = families.family_of(cfg)
    desc = fam.describe(cfg)
    assert fam.name == "qwen3_moe" and desc.moe_layers == (False, True, True, True)
    assert (desc.num_experts, desc.topk, desc.moe_ffn, desc.norm_topk_prob) == (4, 2, 32, True)
    src = mapping.HFSource(path=path)
    rows = fam.param_maps(desc)
    exported = [h for pm in rows if pm.export for h in pm.hf]
    assert sorted(exported) == sorted(src.names())
    assert {pm.expert for pm in rows if ".experts." in pm.megatron} == {0, 1, 2, 3}
    assert all(pm.layer == 0 for pm in rows if pm.megatron.startswith("decoder.layers.0.mlp."))
    d = desc.dims(desc.padded_vocab(128, 2))
    for pm in rows:
        shards = [mapping.to_megatron_shard(pm, src, d, 2, r) for r in range(2)]
        if pm.layout == "gate_up":  # each TP / expert-TP shard holds matching gate and up halves
            g0 = src(pm.hf[0]).chunk(2, 0)[0]
            assert torch.equal(shards[0][: g0.shape[0]], g0)
        for name, t in mapping.to_hf(pm, shards, d):
            assert torch.equal(t, src(name)), (pm.megatron, name)


def test_qwen3_moe_layers_follow_mlp_only_layers_and_sparse_step():
    import transformers

    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=6, num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3],
                                      hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    desc = families.family_of(cfg).describe(cfg)
    assert desc.moe_layers == (False, True, False, False, False, True)
    names = [pm.megatron for pm in families.family_of(cfg).param_maps(desc)]
    assert "decoder.layers.3.mlp.linear_fc1.weight" in names and "decoder.layers.5.mlp.router.weight" in names
    assert not any(n.startswith("decoder.layers.2.mlp.experts") for n in names)


@pytest.mark.parametrize("norm", [True, False])
def test_megatron_routing_settings_equal_transformers_router(norm):
    """The TransformerConfig settings of :func:`moe_kwargs` make megatron's top-k routing produce
    transformers' Qwen3-MoE routing weights (per token and expert); the other setting does not."""
    import transformers
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from megaforge.trainer.megatron.model import moe_kwargs

    cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    desc = families.describe_qwen3_moe(transformers.Qwen3MoeConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4))
    kw = moe_kwargs(desc, on_cpu=True)
    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(cfg)
    router.weight.data.normal_(0, 1.0)
    x = torch.randn(50, 16)
    logits, scores, idx = router(x)  # megatron routes the same logits: the comparison is of the routing alone
    want = torch.zeros(50, 8).scatter(1, idx, scores)
    for pre_softmax, should_match in ((kw["moe_router_pre_softmax"], True), (not kw["moe_router_pre_softmax"], False)):
        probs, rmap = topk_routing_with_score_function(logits, kw["moe_router_topk"], use_pre_softmax=pre_softmax,
                                                       score_function=kw["moe_router_score_function"])
        diff = (probs - want).abs().max().item()
        # float32 weights in [0, 1] from an 8-way softmax and a 3-term renormalisation of the same
        # logits: a few ulp (1.2e-7) when the formulas match, measured on every kernel set; the other
        # setting differs by 0.136. 1e-5 sits between, >= 80 ulp from either
        assert (diff <= 1e-5) == should_match, (pre_softmax, diff)
        assert torch.equal(rmap, want > 0)


def test_checkpoint_key_renames_only_moe_pre_mlp_norm():
    moe = lambda i: i != 0  # noqa: E731
    k = families.checkpoint_key_to_spec
    assert k("decoder.layers.2.mlp.linear_fc1.layer_norm_weight", "torch", "te", moe) == "decoder.layers.2.pre_mlp_layernorm.weight"
    assert k("decoder.layers.2.pre_mlp_layernorm.weight", "te", "torch", moe) == "decoder.layers.2.mlp.linear_fc1.layer_norm_weight"
    for same in ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                 "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight", "embedding.word_embeddings.weight"):
        assert k(same, "torch", "te", moe) == same
    assert families.spec_name("decoder.layers.1.pre_mlp_layernorm.weight", "te", moe_layer=True) == \
        "decoder.layers.1.pre_mlp_layernorm.weight"
    assert families.spec_name("decoder.layers.1.pre_mlp_layernorm.weight", "te") == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"


def test_random_init_moe_state_dict_splits_into_the_checkpoint_tensors(tiny_hf):
    """transformers 5 holds a Qwen3-MoE's experts fused in memory; split_fused_experts gives back the
    per-expert tensors of its own checkpoint, equal to them (the megatron trainer's random init reads
    these names)."""
    import transformers
    from safetensors.torch import load_file

    path = tiny_hf["qwen3_moe"]
    fused = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    disk = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            disk.update(load_file(os.path.join(path, f)))
    split = families.split_fused_experts(fused)
    assert sorted(split) == sorted(disk)
    for k, v in disk.items():
        assert torch.equal(split[k], v), k


def test_grouped_expert_names_follow_te_grouped_mlp():
    """TEGroupedMLP holds local expert k's projections as ``linear_fcN.weight{k}`` of one grouped linear
    layer; every other name is unchanged; a malformed expert name fails naming it."""
    g = families.grouped_expert_name
    assert g("decoder.layers.3.mlp.experts.local_experts.0.linear_fc1.weight") == "decoder.layers.3.mlp.experts.linear_fc1.weight0"
    assert g("decoder.layers.0.mlp.experts.local_experts.17.linear_fc2.weight") == "decoder.layers.0.mlp.experts.linear_fc2.weight17"
    for same in ("decoder.layers.3.mlp.router.weight", "decoder.layers.3.mlp.linear_fc1.weight", "output_layer.weight"):
        assert g(same) == same
    with pytest.raises(ValueError, match="local_experts.x.linear_fc1.weight: not a SequentialMLP expert"):
        g("decoder.layers.3.mlp.experts.local_experts.x.linear_fc1.weight")


def test_moe_experts_setting_resolves_per_layer_spec():
    pytest.importorskip("megatron.core")
    from megaforge.trainer.megatron.model import grouped_experts

    assert grouped_experts("auto", "te") and not grouped_experts("auto", "torch")
    assert not grouped_experts("sequential", "te") and grouped_experts("grouped", "te")
    with pytest.raises(ValueError, match="trainer.moe_experts=grouped needs trainer.layer_spec te"):
        grouped_experts("grouped", "torch")


def test_layout_world_sizes():
    assert Layout(2, 2).world() == 4
    assert Layout(2, 2, 2, 1).world() == 4
    assert Layout(2, 2, 2).world() == 8  # expert-TP = TP: 2 x 2 expert ranks per stage
    assert Layout(1, 1, 4, 1).world() == 4
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("100KB") == 100_000


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate([100, 100, 700, 50, 50, 50, 10])]


def test_hf_writer_shards_greedily_like_transformers(tmp_path):
    """1000-byte shards over tensors of 400, 400, 2800 (alone: larger than the limit), 200 x 3, 40
    bytes; index names and total size as transformers; bf16 cast; config dtype set."""
    import transformers
    from safetensors import safe_open

    cfg = transformers.LlamaConfig(vocab_size=10, hidden_size=8, num_attention_heads=2, num_hidden_layers=1)
    out = str(tmp_path / "out")
    with HFWriter(out, 1000, dtype=torch.bfloat16) as w:
        for n, t in _tensors():
            w.add(n, t)
        w.finish(cfg)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    groups = {}
    for n, fn in idx["weight_map"].items():
        groups.setdefault(fn, []).append(n)
    assert sorted(sorted(v) for v in groups.values()) == [["t0", "t1"], ["t2"], ["t3", "t4", "t5", "t6"]]
    assert sorted(groups) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert idx["metadata"] == {"total_parameters": 1060, "total_size": 2120}
    with safe_open(os.path.join(out, groups_key(groups, "t2")), "pt") as f:
        assert f.get_tensor("t2").dtype == torch.bfloat16
        assert torch.equal(f.get_tensor("t2"), dict(_tensors())["t2"].to(torch.bfloat16))
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    assert os.path.exists(os.path.join(out, "generation_config.json"))
    assert leftovers(out) == []


def groups_key(groups, name):
    return next(fn for fn, names in groups.items() if name in names)


def test_hf_writer_is_atomic(tmp_path):
    """A failure leaves the previous directory untouched and no temporary folder; a duplicate
    tensor is an error; overwrite=False refuses a non-empty directory."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=10, hidden_size=8, num_attention_heads=2, num_hidden_layers=1)
    out = str(tmp_path / "out")
    os.makedirs(out)
    open(os.path.join(out, "old.txt"), "w").close()
    with pytest.raises(ValueError, match="t0.*written twice"):
        with HFWriter(out, 10**6) as w:
            w.add("t0", torch.zeros(3))
            w.add("t0", torch.zeros(3))
    assert os.listdir(out) == ["old.txt"] and leftovers(out) == []
    with pytest.raises(FileExistsError, match="not empty"):
        HFWriter(out, 10**6, overwrite=False)
    with HFWriter(out, 10**6) as w:
        w.add("t0", torch.zeros(3))
        w.finish(cfg)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output_dir(str(tmp_path / "x")) as tmp:
            open(os.path.join(tmp, "half"), "w").close()
            raise RuntimeError("boom")
    assert not os.path.exists(tmp_path / "x") and leftovers(str(tmp_path / "x")) == []


def test_spawn_stops_the_ranks_and_cleans_up_on_failure(tmp_path):
    """Rank 1 fails after a temporary output folder exists while rank 0 would run for a minute:
    spawn returns the failing exit code quickly, stops rank 0, and on_failure removes the folder."""
    import shutil
    import time

    script = tmp_path / "rank.py"
    out = tmp_path / "out"
    script.write_text(
        "import os, sys, time\n"
        f"os.makedirs({str(tmp_path)!r} + '/.out.tmp-abc', exist_ok=True)\n"
        "if os.environ['RANK'] == '1':\n    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(60)\n")
    t0 = time.time()
    code = spawn(str(script), [], 2, on_failure=lambda: [shutil.rmtree(tmp_path / f) for f in leftovers(str(out))],
                 grace_s=0.5)
    assert code == 3 and time.time() - t0 < 20
    assert leftovers(str(out)) == [] and not out.exists()
    ok = tmp_path / "ok.py"
    ok.write_text("import os\nassert os.environ['WORLD_SIZE'] == '3' and os.environ['MASTER_ADDR']\n")
    assert spawn(str(ok), [], 3) == 0
    assert sys.executable


def test_torch_backend_export_is_sharded_when_large_and_atomic(tiny_hf, tmp_path):
    """The torch backend's export (transformers' writer) shards with an index above its limit,
    splits the fused experts back per expert, and leaves no temporary folder."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron"))
    from cv_helpers import hf_state, load_hf_checked
    from mt_helpers import trainer_cfg

    from megaforge.trainer.torch_backend import TorchTrainer

    tr = TorchTrainer(RunBuilder(trainer_cfg(tiny_hf["qwen3_moe"], "torch")).trainer_spec())
    tr.export_max_shard_bytes = 100_000
    out = str(tmp_path / "hf" / "step_1")
    tr.export_hf(out)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    got, want = hf_state(out), hf_state(tiny_hf["qwen3_moe"])
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    load_hf_checked(out)
    assert leftovers(out) == []
