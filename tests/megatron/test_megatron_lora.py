"""LoRA on the Megatron backend (megaforge.trainer.megatron.lora; issue 43 point 1), on gloo process groups,
fp32, the tiny Qwen2 (q/k/v biases, 2 query heads per key/value group, so the fused qkv slices matter):
logprobs with nonzero adapters equal HF + PEFT's with the same adapters; gradients at TP2, TP2 + SP and
PP2 equal TP1's and the torch backend's (PEFT); only adapters train, the base stays bit-equal;
adapters-only checkpoints resume bit-exactly and load at another layout; the PEFT folder loads in peft;
the merged weights the engines get; the refusals. Plus the pure name / shard table of megaforge.convert."""
import json
import os

import pytest
import torch

from mt_helpers import make_batch, model_logprobs, run_workers, trainer_cfg

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_worker.py")
# float32 logprobs: the bound of test_megatron_parity.py (measured <= 9.5e-7 there, ~20 ulp); adapters
# with entries ~0.1 move the logprobs by ~0.1-1, so a wrong slot or a missing reduction shows by far more
TOL = 1e-5
# gradients: float32 sums over 50 tokens in other orders (TP / SP / PP reductions, PEFT's separate
# q / k / v matmuls); relative to the largest entry of each tensor: measured <= 2.1e-6 (TP2 vs TP1),
# bound 10x that. A missing all-reduce halves a gradient, a wrong slot moves it by ~100%.
GRAD_RTOL = 2e-5
LAYOUTS = [{}, {"tp": 2}, {"tp": 2, "sp": True}, {"pp": 2}]  # {}: TP1 (x DP2 on two ranks)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_cfg(model, backend="torch", **trainer):
    from megaforge.config.model import LoraConfig

    cfg = trainer_cfg(model, backend, **trainer)
    cfg.model.lora = LoraConfig(rank=4, alpha=8.0, target_modules=list(TARGETS))
    return cfg


def _adapters(model, path) -> dict:
    """Nonzero full adapters (A and B ~ 0.1 N(0, 1)) by PEFT name, saved for the workers."""
    import peft
    import transformers

    from megaforge.trainer.lora import peft_config

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft_config(_lora_cfg(model).model.lora))
    g = torch.Generator().manual_seed(7)
    full = {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in peft.get_peft_model_state_dict(pm).items()}
    torch.save(full, path)
    return full


def _torch_reference(model, full):
    """The torch backend (PEFT) with adapters ``full``: logprobs, and the gradients of one RL step by PEFT name."""
    from megaforge.build import RunBuilder
    from megaforge.trainer.torch_backend import TorchTrainer

    tr = TorchTrainer(RunBuilder(_lora_cfg(model, grad_clip=0.0)).trainer_spec())
    own = {n: full["base_model.model." + n.replace(".default", "")] for n, _ in tr.lora.adapter_parameters()}
    tr.lora.load_adapter_state(own, "test adapters")
    batch = make_batch()
    lp = tr.compute_logprobs(batch)
    grads = {}
    step = tr._clip_and_step

    def capture():
        grads.update({"base_model.model." + n.replace(".default", ""): p.grad.detach().clone()
                      for n, p in tr.lora.adapter_parameters()})
        return step()

    tr._clip_and_step = capture
    tr.train_step(batch)
    return lp, grads


def layout_of(key: str) -> dict:
    return {"dp2": {}, "tp2": {"tp": 2}, "sp1_tp2": {"tp": 2, "sp": True}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}[key]


def _planned(model, layout, stage) -> int:
    """megaforge.planner.memory.megatron_lora_params of this rank (the planner's per-rank adapter count)."""
    from megaforge.config.model import LoraConfig
    from megaforge.planner.memory import megatron_lora_params
    from megaforge.planner.shapes import shape_from_dict

    shape = shape_from_dict(json.load(open(os.path.join(model, "config.json"))))
    return megatron_lora_params(shape, LoraConfig(rank=4, target_modules=list(TARGETS)), layout.get("tp", 1),
                                layout.get("pp", 1), stage)


def _grad_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n in want)


def test_lora_layouts_logprobs_gradients_and_frozen_base(tiny_models, tmp_path):
    """Qwen2 at TP1 (x DP2), TP2, TP2 + SP, PP2, CP2; the tied-embedding Llama at PP2 (the frozen shared
    embedding of the first and last stage)."""
    from mt_helpers import hf_logprobs

    runs, refs = [], {}
    for name, layouts in (("qwen2", LAYOUTS + [{"cp": 2}]), ("llama_tied", [{}, {"pp": 2}])):
        model, adapters = tiny_models[name], str(tmp_path / f"{name}_adapters.pt")
        full = _adapters(model, adapters)
        runs += [(name, model, adapters, layout) for layout in layouts]
        refs[name] = _torch_reference(model, full)
        assert float((hf_logprobs(model, make_batch(), 0.8) - refs[name][0]).abs().max()) > 0.05  # adapters matter
    res = run_workers("layouts", 2, {"runs": runs}, tmp_path, worker=WORKER, timeout=300)
    for (name, key), r in res[0].items():
        model, (want_lp, want_g), tp1 = tiny_models[name], refs[name], res[0][(name, "dp2")]["grads"]
        assert float(max(t.abs().max() for t in tp1.values())) > 0
        d = float((r["logprobs"] - want_lp).abs().max())
        dg, dt = _grad_diff(r["grads"], tp1), _grad_diff(r["grads"], want_g)
        print(f"{name} {key}: |logprob - HF+PEFT| {d:.3g}; gradients vs TP1 {dg:.3g}, vs PEFT {dt:.3g} (relative)")
        assert d <= TOL, f"{key}: max |logprob - HF+PEFT| = {d:.3g}"
        assert dg <= GRAD_RTOL, f"{key}: adapter gradients differ from TP1's by {dg:.3g} (relative)"
        assert dt <= GRAD_RTOL, f"{key}: adapter gradients differ from the torch backend's (PEFT) by {dt:.3g}"
        for rank in res:
            rr = rank[(name, key)]
            assert rr["adapter_numel"] == _planned(model, layout_of(key), rr["stage"]), key  # the planner's count
            assert rr["requires_grad_are_adapters"] and rr["ddp_holds_adapters"] and rr["optimizer_holds_adapters"], key
            assert rr["base_bit_equal"], f"{key}: a base parameter changed"
            # the frozen output layer's backward stays one GEMM (26 s steps instead of ~6 on the H100 without it)
            assert rr["vocab_bmm"] == [], f"{key}: the logits' gradient met the frozen weight per token: {rr['vocab_bmm']}"
            assert rr["adapters_moved"] == 1.0, f"{key}: only {rr['adapters_moved']:.0%} of the adapter tensors moved"
        assert torch.equal(res[1][(name, key)]["logprobs"], r["logprobs"])
        # the initial adapters: B = 0, A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's Kaiming) from a generator seeded
        # per (seed, layer, projection), so every layout starts from the same adapters
        init, first = r["init"], res[0][(name, "dp2")]["init"]
        assert r["init_fresh"] and set(init) == set(first) == set(want_g)
        assert all(torch.equal(init[n], first[n]) for n in init), f"{name} {key}: the initial adapters depend on the layout"
        for n, t in init.items():
            if ".lora_B." in n:
                assert not t.any(), n
            else:
                bound = t.shape[1] ** -0.5
                assert t.abs().max() <= bound and abs(float(t.std()) - bound / 3 ** 0.5) < 0.25 * bound, n


def test_lora_resume_layout_change_peft_folder_and_merged_sync(tiny_models, tmp_path):
    import peft
    import transformers

    model = tiny_models["qwen2"]
    _adapters(model, str(tmp_path / "adapters.pt"))
    spec = {"model": model, "adapters": str(tmp_path / "adapters.pt"), "layout1": {"tp": 2}, "layout2": {"pp": 2},
            "layout3": {}}  # TP1 x DP2: the distributed optimizer's state split over two DP ranks
    r = run_workers("resume", 2, spec, tmp_path, worker=WORKER, timeout=240)[0]
    assert r["dist_opt_holds_adapters"]  # megatron's distributed optimizer: the adapters alone
    # 2 steps, save, load, 1 step == 3 straight steps: bit for bit
    assert set(r["resumed"]) == set(r["straight"])
    assert all(torch.equal(r["resumed"][n], r["straight"][n]) for n in r["straight"])
    assert any(not torch.equal(r["at_save"][n], r["straight"][n]) for n in r["straight"])  # step 3 moved them
    # the TP2 checkpoint at PP2 and at TP1 x DP2: the same adapters (exact), logprobs within float rounding, a step
    # close to TP2's third (Adam's first steps amplify float rounding, see test_megatron_parity.WEIGHT_TOL)
    for key in ("other_layout", "third_layout"):
        assert all(torch.equal(r[f"{key}_loaded"][n], r["at_save"][n]) for n in r["at_save"]), key
        assert float((r[f"{key}_logprobs"] - r["at_save_logprobs"]).abs().max()) <= TOL, key
        d = max(float((r[f"{key}_stepped"][n] - r["straight"][n]).abs().max()) for n in r["straight"])
        print(f"{key}: |adapters after the third step - TP2's| {d:.3g}")
        assert d <= 3e-5, f"{key}: the step after loading moved the adapters {d:.3g} away from TP2's third step"
    # the checkpoint holds adapters (+ optimizer state), not the base; its metadata names the base
    meta = json.load(open(tmp_path / "ck" / "megaforge_trainer.json"))
    assert meta["lora"]["base"] == os.path.abspath(model) and meta["lora"]["rank"] == 4 and meta["optimizer"]
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata
    tensors = {k for k in keys if ".lora_" in k or "base_model." in k}
    assert {k.split("base_model.")[0] for k in tensors} == {"", "optimizer.state.param.", "optimizer.state.exp_avg.",
                                                          "optimizer.state.exp_avg_sq."}
    assert len(tensors) == 4 * 4 * 7 * 2  # layers x projections x (A, B), each with its Adam state
    assert not any("decoder." in k or "embedding" in k for k in keys)  # no base weight
    from megaforge.trainer.megatron.convert import open_checkpoint

    with pytest.raises(ValueError, match=r"is a LoRA checkpoint \(model.lora\): it holds the adapters of the base"):
        open_checkpoint(str(tmp_path / "ck"))  # tools/convert_megatron_to_hf.py, a run source's export
    # the PEFT folder loads in peft and gives the trainer's logprobs
    folder = str(tmp_path / "adapter")
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    pm = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                        folder)
    d = float((_peft_logprobs(pm, make_batch()) - r["straight_logprobs"]).abs().max())
    assert d <= TOL, f"PEFT folder: max |logprob - trainer| = {d:.3g}"
    # the merged weights the engines get: W + s B A under the HF names (every tensor), the adapted policy
    plain = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    base = {n: t.clone() for n, t in plain.state_dict().items()}
    assert set(r["merged"]) == set(base)
    plain.load_state_dict(r["merged"])
    d = float((hf_logprobs_of(plain) - r["straight_logprobs"]).abs().max())
    assert d <= TOL, f"merged weights: max |logprob - trainer| = {d:.3g}"
    assert torch.equal(r["merged"]["model.norm.weight"], base["model.norm.weight"])  # not adapted: the base


def hf_logprobs_of(model):
    return _peft_logprobs(model, make_batch())


def _peft_logprobs(model, batch, temperature=0.8):
    return model_logprobs(model, batch, temperature)


def test_lora_dropout_draws_one_mask_per_adapter(tiny_models, tmp_path):
    """model.lora.dropout on the megatron backend (one low-rank pair per linear, megaforge.trainer.megatron.lora):
    in training, each adapter's x is dropped with its own mask, as PEFT's separate dropout modules do; the hook equals
    the adapters computed one by one from the same seed; in eval there is no dropout. float32: the same products in
    another grouping, within TOL."""
    model = tiny_models["qwen2"]
    _adapters(model, str(tmp_path / "adapters.pt"))
    res = run_workers("dropout", 2, {"model": model, "adapters": str(tmp_path / "adapters.pt")}, tmp_path,
                      worker=WORKER, timeout=240)
    for lname, r in res[0].items():
        assert r["train_diff"] <= TOL and r["eval_diff"] <= TOL, (lname, r)
        assert r["dropout_moves"] > 1e-3, (lname, r)  # the masks reached the adapters


# ------------------------------------------------------------------------------------------- refusals
def test_refusals_name_the_keys():
    from megaforge.config import load_config
    from megaforge.config.model import LoraConfig
    from megaforge.configtree import ConfigError
    from megaforge.convert.families import ModelDesc
    from megaforge.trainer.megatron.lora import check_lora

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                        "demo_cpu.yaml")
    base = ["--config", demo, "--model.lora.rank", "4", "--trainer.backend", "megatron"]
    assert load_config(base).model.lora.rank == 4
    with pytest.raises(ConfigError, match=r"'model.lora': with trainer.backend megatron needs trainer.layer_spec torch"):
        load_config(base + ["--trainer.layer_spec", "te"])
    with pytest.raises(ConfigError, match=r"'model.lora': with trainer.backend megatron has no FP8 path: set trainer.fp8"):
        load_config(base + ["--trainer.fp8", "hybrid"])
    t = load_config(base).trainer
    dense = ModelDesc("qwen2", 4, 64, 96, 4, 2, 16, 250, 1e4, 1e-6, 128, False, True, False)
    moe = ModelDesc("qwen3_moe", 2, 64, 96, 4, 2, 16, 250, 1e4, 1e-6, 128, False, False, True, num_experts=4,
                    moe_ffn=32, topk=2, moe_layers=(True, True))
    check_lora(LoraConfig(), t, "torch", dense)  # every projection of a dense model
    check_lora(LoraConfig(target_modules=["q_proj", "o_proj"]), t, "torch", moe)  # a MoE model's attention
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['gate_proj', 'up_proj', 'down_proj'\] would "
                                          "target the mixture-of-experts layers' experts"):
        check_lora(LoraConfig(), t, "torch", moe)
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['lm_head'\] on trainer.backend megatron"):
        check_lora(LoraConfig(target_modules=["q_proj", "lm_head"]), t, "torch", dense)
    with pytest.raises(ConfigError, match=r"model.lora with trainer.layer_spec 'auto' \(resolved to 'te'\)"):
        check_lora(LoraConfig(), t, "te", dense)


# ------------------------------------------------------------------------------- names (pure, CPU)
def test_adapter_name_table_and_shards_follow_the_weight_layouts():
    from megaforge.convert import lora_names as ln
    from megaforge.convert.layouts import Dims, fuse_qkv, get_layout, split_qkv

    rows = ln.stage_table(4, 2, 1, ["q_proj", "down_proj"])  # PP2, second stage: global layers 2, 3
    assert [(r.megatron, r.peft, r.split_axis) for r in rows[:4]] == [
        ("decoder.layers.0.self_attention.linear_qkv.lora.q_proj.lora_A",
         "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight", None),
        ("decoder.layers.0.self_attention.linear_qkv.lora.q_proj.lora_B",
         "base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight", 0),
        ("decoder.layers.0.mlp.linear_fc2.lora.down_proj.lora_A",
         "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight", 1),
        ("decoder.layers.0.mlp.linear_fc2.lora.down_proj.lora_B",
         "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight", None)]
    assert len(rows) == 8 and ln.to_peft(rows[-1].megatron, 2) == rows[-1].peft
    # TP2 on one stage and PP2 at TP1 name every adapter tensor once, by the same PEFT names
    tp = {r.peft for r in ln.stage_table(4, 1, 0, ln.TARGETS)}
    pp = {r.peft for s in (0, 1) for r in ln.stage_table(4, 2, s, ln.TARGETS)}
    assert tp == pp and len(tp) == 4 * 7 * 2
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        ln.stage_table(4, 1, 0, ["lm_head"])
    # shard / merge round trip; and B's shard of rank t is the rows of the projection that rank t's
    # shard of megatron's fused weight holds (qkv groups, gate / up halves)
    d = Dims(hidden=8, num_heads=4, num_kv_heads=2, head_dim=3, ffn=6, vocab=10, padded_vocab=10)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * 3, 8, generator=g) for n in (4, 2, 2))
    gate, up = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    local = Dims(8, 2, 1, 3, 3, 10, 10)
    for t in range(2):
        qs, ks, vs = split_qkv(get_layout("qkv").shard(fuse_qkv(q, k, v, d), 2, t, d), local)
        assert torch.equal(qs, ln.shard(q, "q_proj", "lora_B", 2, t)) and torch.equal(ks, ln.shard(k, "k_proj", "lora_B", 2, t))
        assert torch.equal(vs, ln.shard(v, "v_proj", "lora_B", 2, t))
        fc1 = get_layout("gate_up").shard(torch.cat([gate, up]), 2, t, d)
        assert torch.equal(fc1[:3], ln.shard(gate, "gate_proj", "lora_B", 2, t))
        assert torch.equal(fc1[3:], ln.shard(up, "up_proj", "lora_B", 2, t))
    for proj, ab in (("q_proj", "lora_A"), ("q_proj", "lora_B"), ("o_proj", "lora_A"), ("down_proj", "lora_B")):
        x = torch.randn(8, 6, generator=g)
        assert torch.equal(ln.merge([ln.shard(x, proj, ab, 2, t) for t in range(2)], proj, ab), x)
