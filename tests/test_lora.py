"""LoRA on the torch backend (model.lora, megaforge.trainer.lora): config errors, adapters-only training,
the reference as the base with adapters off, merged weights for the engines and the HF export, the PEFT
adapter folder, adapters-only checkpoints that resume bit-exactly, and a short run whose base weights
stay bit-equal."""
import os

import pytest
import torch
from run_helpers import run_in_process

from megaforge.build import RunBuilder
from megaforge.config import config_from_dict, load_config
from megaforge.configtree import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--sft.max_steps", "0", "--rollout.batch_size", "4", "--grpo.n_samples", "4", "--rollout.max_new_tokens", "8",
        "--metrics.progress", "false"]
#: float32 sums of the merged W + s B A against the adapted forward x W^T + s (x A^T) B^T: same terms,
#: other rounding order; logprobs of a 2-layer model of width 64 agree to ~1e-6
MERGE_TOL = 2e-5


def cfg_for(model_dir, tmp_path, **lora):
    return config_from_dict({
        "output_dir": str(tmp_path), "run_name": "t", "max_steps": 2, "seed": 0,
        "model": {"path": model_dir, "lora": {"rank": 4, "alpha": 8.0, **lora}},
        "data": {"path": "arithmetic", "format": "synthetic"},
        "grpo": {"beta": 0.01}, "trainer": {"backend": "torch", "lr": 1e-2, "micro_batch_size": 4,
                                             "mini_batches": 2},
    })


def batch_for(tok, n=4, T=20, seed=0):
    from megaforge.data.batch import set_denominators
    from megaforge.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 500, (n, T), generator=g)
    lengths = torch.tensor([T, T - 3, T - 5, T - 1][:n])
    mask = torch.zeros(n, T)
    for i, L in enumerate(lengths.tolist()):
        mask[i, 8:L] = 1
        tokens[i, L:] = tok.pad_token_id
    adv = torch.randn(n, generator=g)[:, None] * mask
    return set_denominators(TrainBatch(tokens=tokens, lengths=lengths, loss_mask=mask, advantages=adv,
                                       old_logprobs=torch.zeros(n, T), rollout_logprobs=torch.zeros(n, T)))


def trainer_for(model_dir, tmp_path, tokenizer, **lora):
    from megaforge.trainer.torch_backend import TorchTrainer

    torch.manual_seed(0)
    t = TorchTrainer(RunBuilder(cfg_for(model_dir, tmp_path, **lora)).trainer_spec(), tokenizer)
    t.reset_optimizer(1e-2, 10)
    return t


def train(t, batch):
    b = batch
    b.old_logprobs = t.compute_logprobs(batch, "policy", "trained")
    if t._lora_ref or t.ref is not None:
        b.ref_logprobs = t.compute_logprobs(batch, "ref", "trained")
    return t.train_step(b)


def plain_logprobs(model, batch, temperature=1.0):
    from megaforge.trainer.causal_lm import causal_lm_logprobs

    with torch.no_grad():
        return causal_lm_logprobs(model, batch.tokens, batch.lengths, temperature, False, "off")[0]


# ------------------------------------------------------------------------------------------- config
def test_target_that_matches_no_module_names_the_key_and_the_modules(tiny_model_dir, tokenizer, tmp_path):
    with pytest.raises(ConfigError) as e:
        trainer_for(tiny_model_dir, tmp_path, tokenizer, target_modules=["q_proj", "xyz"])
    assert str(e.value) == ("model.lora.target_modules: 'xyz' matches no module; modules: q_proj, k_proj, v_proj, "
                            "o_proj, gate_proj, up_proj, down_proj, lm_head")
    # through the launcher: one line, before any step
    rc, _, err = run_in_process("grpo", ["--config", DEMO, *TINY, "--output_dir", str(tmp_path), "--run_name", "x",
                                         "--model.lora.target_modules", "[xyz]"])
    assert rc == 1
    assert "megaforge: config error: model.lora.target_modules: 'xyz' matches no module; modules: q_proj" in err


def test_config_keys_and_refusals():
    c = load_config(["--config", DEMO, "--model.lora.rank", "4"])  # one dotted key enables the section
    assert (c.model.lora.rank, c.model.lora.alpha, c.model.lora.dropout) == (4, 16.0, 0.0)
    assert load_config(["--config", DEMO]).model.lora is None
    with pytest.raises(ConfigError, match="'model.lora.rank': must be >= 1"):
        load_config(["--config", DEMO, "--model.lora.rank", "0"])
    with pytest.raises(ConfigError, match="did you mean 'model.lora.rank'"):
        load_config(["--config", DEMO, "--model.lora.rnk", "4"])
    # the megatron backend takes it (megaforge.trainer.megatron.lora) with the torch layer spec and no FP8
    assert load_config(["--config", DEMO, "--model.lora.rank", "4", "--trainer.backend", "megatron"]).model.lora.rank == 4
    with pytest.raises(ConfigError, match="'model.lora': with trainer.backend megatron needs trainer.layer_spec torch"):
        load_config(["--config", DEMO, "--model.lora.rank", "4", "--trainer.backend", "megatron",
                     "--trainer.layer_spec", "te"])
    with pytest.raises(ConfigError, match="'model.lora': with trainer.backend megatron has no FP8 path"):
        load_config(["--config", DEMO, "--model.lora.rank", "4", "--trainer.backend", "megatron", "--trainer.fp8", "hybrid"])
    with pytest.raises(ConfigError, match="'model.lora': the PPO critic"):
        load_config(["--config", DEMO, "--model.lora.rank", "4", "--algo.advantage", "gae"])


# ------------------------------------------------------------------------------------------ trainer
def test_adapters_alone_train_and_reference_is_the_base(tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    t = trainer_for(tiny_model_dir, tmp_path, tokenizer)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    opt_params = [p for g in t.opt.param_groups for p in g["params"]]
    assert {id(p) for p in opt_params} == {id(p) for _, p in t.lora.adapter_parameters()}
    assert all(".lora_" in n for n, _ in t.lora.adapter_parameters())
    n_adapter = sum(p.numel() for p in opt_params)
    # r (in + out) per adapted linear: q 64->64, k 64->32, v 64->32, o 64->64, gate/up 64->128, down 128->64; 2 layers
    assert n_adapter == 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    before = {n: v.clone() for n, v in t.lora.base_state()}
    batch = batch_for(tokenizer)
    assert t.lora.fresh()
    t.snapshot_reference()
    assert t.ref is None and t._ref_adapters is None  # no second copy of the model
    m = train(t, batch)
    assert m["updates"] == 2 and m["skipped"] == 0
    assert not t.lora.fresh()
    after = dict(t.lora.base_state())
    assert all(torch.equal(before[n], after[n]) for n in before)  # base bit-equal
    assert all(p.grad is None for p in t.model.parameters() if not p.requires_grad)
    assert len([k for s in t.opt.state.values() for k in s]) == 3 * len(opt_params)  # step, exp_avg, exp_avg_sq
    # the reference: the base with adapters off, equal to the base model loaded alone
    ref = t.compute_logprobs(batch, "ref")
    assert torch.equal(ref, plain_logprobs(base, batch) * (ref != 0))
    pol = t.compute_logprobs(batch, "policy")
    assert (pol - ref).abs().max() > 1e-3  # the adapters moved the policy


def test_engines_get_merged_weights_and_exports_load(tiny_model_dir, tokenizer, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    t = trainer_for(tiny_model_dir, tmp_path, tokenizer)
    batch = batch_for(tokenizer)
    for _ in range(2):
        train(t, batch)
    pol = t.compute_logprobs(batch, "policy")
    # what the weight sync hands the engines: the merged weights under the HF names
    merged = dict(kv for bucket in t.iter_hf_buckets(1 << 20) for kv in bucket)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert set(merged) == set(plain.state_dict()) - {"lm_head.weight"}
    plain.load_state_dict(merged, strict=False)
    assert (plain_logprobs(plain, batch) - pol).abs().max() < MERGE_TOL
    # --export_hf_every: merged HF weights
    t.export_hf(str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert all(torch.equal(hf.state_dict()[n], v) for n, v in merged.items())
    # the same tensor names as the base's own files: a tied lm_head stays tied, not written as a second copy
    # (tools/check_lora_run.py reads the export against the base name by name)
    from safetensors.torch import load_file
    assert plain.config.tie_word_embeddings
    assert set(load_file(str(tmp_path / "hf" / "model.safetensors"))) == set(
        load_file(os.path.join(tiny_model_dir, "model.safetensors")))
    # the PEFT adapter folder, loaded by peft on the base
    t.export_adapter(str(tmp_path / "adapter"))
    assert sorted(os.listdir(tmp_path / "adapter"))[:2] == ["README.md", "adapter_config.json"]
    pm = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                        str(tmp_path / "adapter"))
    assert torch.equal(plain_logprobs(pm, batch), pol)


def test_checkpoint_holds_adapters_and_resumes_bit_exactly(tiny_model_dir, tokenizer, tmp_path):
    batch, batch2 = batch_for(tokenizer, seed=0), batch_for(tokenizer, seed=1)
    a = trainer_for(tiny_model_dir, tmp_path, tokenizer)
    a.snapshot_reference()
    train(a, batch)
    a.save(str(tmp_path / "ck"))
    state = torch.load(tmp_path / "ck" / "trainer.pt", weights_only=True)
    assert "model" not in state and set(state["lora"]) == {n for n, _ in a.lora.adapter_parameters()}
    assert state["lora_ref"] == {}  # the reference is the base (adapters off)
    train(a, batch2)
    want = {n: p.detach().clone() for n, p in a.lora.adapter_parameters()}

    b = trainer_for(tiny_model_dir, tmp_path, tokenizer)
    b.load(str(tmp_path / "ck"))
    train(b, batch2)
    got = dict(b.lora.adapter_parameters())
    assert all(torch.equal(want[n], got[n]) for n in want)  # bit-equal next-step weights

    # the size: adapters + their AdamW moments against the full model's checkpoint
    from megaforge.trainer.torch_backend import TorchTrainer

    cfg = cfg_for(tiny_model_dir, tmp_path)
    cfg.model.lora = None
    full = TorchTrainer(RunBuilder(cfg).trainer_spec(), tokenizer)
    full.reset_optimizer(1e-2, 10)
    full.snapshot_reference()
    train(full, batch)
    full.save(str(tmp_path / "full"))
    lora_bytes = os.path.getsize(tmp_path / "ck" / "trainer.pt")
    full_bytes = os.path.getsize(tmp_path / "full" / "trainer.pt")
    print(f"trainer.pt: LoRA rank 4 {lora_bytes} B, full fine-tune {full_bytes} B")
    assert lora_bytes < 0.25 * full_bytes

    c = trainer_for(tiny_model_dir, tmp_path, tokenizer)
    with pytest.raises(RuntimeError, match="the checkpoint holds full weights but model.lora is set"):
        c.load(str(tmp_path / "full"))


def test_reference_after_a_lora_warm_start_is_the_warm_started_adapters(tiny_model_dir, tokenizer, tmp_path):
    t = trainer_for(tiny_model_dir, tmp_path, tokenizer)
    batch = batch_for(tokenizer)
    train(t, batch)  # stands for the SFT warm start: the adapters are no longer zero
    start = t.compute_logprobs(batch, "policy")
    t.snapshot_reference()
    assert t._ref_adapters is not None
    train(t, batch)
    assert torch.equal(t.compute_logprobs(batch, "ref"), start)
    assert not torch.equal(t.compute_logprobs(batch, "policy"), start)  # the policy's adapters came back


# ------------------------------------------------------------------------------------------ a run
def test_short_run_keeps_the_base_bit_equal_and_writes_the_adapter(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from megaforge.loop import run_grpo

    argv = ["--config", DEMO, *TINY, "--output_dir", str(tmp_path), "--run_name", "r", "--max_steps", "2",
            "--model.path", tiny_model_dir, "--model.tokenizer", tiny_model_dir, "--model.lora.rank", "4",
            "--trainer.lr", "1e-2", "--checkpoint.interval", "0", "--sft.max_steps", "2", "--sft.batch_size", "8"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        run = run_grpo(load_config(argv))
    finally:
        os.chdir(cwd)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    after = dict(run.trainer.lora.base_state())
    assert set(after) == set(base)
    assert all(torch.equal(after[n], base[n]) for n in base)
    assert not run.trainer.lora.fresh()  # the adapters trained (the LoRA SFT warm start's loss always moves them)
    assert run.trainer._ref_adapters is not None  # the reference: the warm-started adapters on the same base
    assert os.path.exists(tmp_path / "r" / "adapter" / "step_2" / "adapter_model.safetensors")


# ------------------------------------------------------------------------------------- adapter sync
def test_adapters_alone_give_the_embedded_engine_the_merged_weights_bit_for_bit(tiny_model_dir, tokenizer, tmp_path):
    from megaforge.rollout.embedded.engine import EmbeddedEngine
    from megaforge.sync import push_weights
    from megaforge.sync.adapters import push_adapters

    t = trainer_for(tiny_model_dir, tmp_path, tokenizer)
    batch = batch_for(tokenizer)
    engines = []
    for _ in range(2):
        from transformers import AutoModelForCausalLM

        engines.append(EmbeddedEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                      tokenizer, fast="off"))
    merged_e, adapter_e = engines
    for version in (1, 2, 3):  # the engine merges onto its kept base every time: no drift over updates
        train(t, batch)
        full = push_weights(t, merged_e, 1 << 20, version)
        small = push_adapters(t, adapter_e, 1 << 20, version)
        assert adapter_e.weight_version == version
        a, b = merged_e.model.state_dict(), adapter_e.model.state_dict()
        assert all(torch.equal(a[n], b[n]) for n in a)
    print(f"sync bytes per update: merged {full['bytes']} B ({full['tensors']} tensors), adapters alone "
          f"{small['bytes']} B ({small['tensors']} tensors)")
    assert small["bytes"] == 4 * sum(p.numel() for _, p in t.lora.adapter_parameters())
    assert small["bytes"] < full["bytes"]


def test_run_with_adapter_sync_logs_its_bytes(tiny_model_dir, tmp_path):
    import json

    common = ["--config", DEMO, *TINY, "--output_dir", str(tmp_path), "--max_steps", "1", "--model.path", tiny_model_dir,
              "--model.tokenizer", tiny_model_dir, "--model.lora.rank", "4", "--checkpoint.interval", "0"]
    got = {}
    for name, flag in (("merged", "false"), ("adapters", "true")):
        rc, out, err = run_in_process("grpo", [*common, "--run_name", name, "--sync.lora_adapters", flag])
        assert rc == 0, err[-3000:]
        with open(tmp_path / name / "metrics.jsonl") as f:
            got[name] = json.loads(f.readline())["sync/bytes"]
    print(f"run sync/bytes per step: merged {got['merged']:.0f}, adapters {got['adapters']:.0f}")
    assert 0 < got["adapters"] < got["merged"]
    with pytest.raises(ConfigError, match="'sync.lora_adapters': needs model.lora"):
        load_config(["--config", DEMO, "--sync.lora_adapters", "true"])


def test_run_resumed_from_an_adapter_checkpoint_ends_bit_equal(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    common = ["--config", DEMO, *TINY, "--output_dir", str(tmp_path), "--model.path", tiny_model_dir,
              "--model.tokenizer", tiny_model_dir, "--model.lora.rank", "4", "--sft.max_steps", "2",
              "--sft.batch_size", "8", "--checkpoint.interval", "1", "--deterministic", "true",
              "--rewards.functions", "[{name: 'lora_plugins:length_reward'}]"]
    for argv in (["--run_name", "whole", "--max_steps", "3"], ["--run_name", "cut", "--max_steps", "2"],
                 ["--run_name", "cut", "--max_steps", "3", "--resume", "--resume_allow_changes", "max_steps"]):
        rc, out, err = run_in_process("grpo", [*common, *argv])
        assert rc == 0, err[-3000:]
    assert "resumed from" in out
    whole = load_file(tmp_path / "whole" / "adapter" / "step_3" / "adapter_model.safetensors")
    cut = load_file(tmp_path / "cut" / "adapter" / "step_3" / "adapter_model.safetensors")
    assert set(whole) == set(cut) and all(torch.equal(whole[n], cut[n]) for n in whole)
    at_cut = load_file(tmp_path / "cut" / "adapter" / "step_2" / "adapter_model.safetensors")
    assert any(not torch.equal(at_cut[n], cut[n]) for n in cut)  # step 3 moved the adapters
