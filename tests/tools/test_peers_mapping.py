"""tools/peers/mapping.py (issue 39 point 1): every key of the GRPO recipe has a row mapping it to verl's overrides,
TRL's GRPOConfig kwargs and slime's flags; the batch geometry, the peers' micro-batch within the token budget and the
variants (mapped, defaults, best) carry the recipe's values; README.md and NEXT.md show the generated tables. Where
the peers import, their own code takes the mapping: verl's config composition (verl_compose.py), slime's parse_args
(slime_check.py), and TRL's GRPOTrainer for 2 steps on the tiny CPU model (trl_grpo.py, its schema records).
tools/peers is on sys.path through tests/tools/conftest.py."""
import json
import os
import subprocess
import sys

import pytest
import yaml

import mapping
import peer_reward
import schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "configs", "grpo_gsm8k_qwen2.5_0.5b_h200.yaml")


def leaf_keys(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaf_keys(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def recipe_cfg(*extra):
    from megaforge.config import load_config
    return load_config(["--config", RECIPE, *extra])


def test_every_recipe_key_has_a_row_in_the_table():
    with open(RECIPE) as f:
        keys = list(leaf_keys(yaml.safe_load(f)))
    assert sorted(keys) == sorted(mapping.RECIPE_KEYS), "a recipe key was added or removed: map it in tools/peers/mapping.py"
    missing = [k for k in keys if mapping.row_for(k) is None]
    assert missing == []
    assert all(len(row) == 4 and all(row) for row in mapping.TABLE)


def test_batch_geometry_of_the_recipe():
    cfg = recipe_cfg()
    g = mapping.geometry(cfg)
    assert g == {"samples": 512, "per_update": 128, "verl_mini_prompts": 16, "trl_grad_accum": 8,
                 "trl_steps_per_generation": 32, "updates": 4, "micro_batch": 16, "micro_batch_tokens": 16384}
    kw = mapping.trl_kwargs(cfg, 20, "/o")
    assert (kw["max_steps"], kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"],
            kw["steps_per_generation"], kw["save_steps"]) == (80, 16, 8, 32, 40)
    assert (kw["epsilon"], kw["epsilon_high"], kw["beta"], kw["temperature"], kw["learning_rate"]) == (0.2, 0.28, 0.0, 0.7, 3e-6)
    assert kw["gradient_checkpointing"] is False and kw["shuffle_dataset"] is False and kw["loss_type"] == "dapo"
    assert mapping.trl_kwargs(cfg, 20, "/o", use_vllm=True)["vllm_importance_sampling_correction"] is False
    # TRL's own defaults where they are not the algorithm: checkpointing on, micro-batches of 8; same 128 an update
    d = mapping.trl_kwargs(cfg, 20, "/o", variant="defaults")
    assert (d["per_device_train_batch_size"], d["gradient_accumulation_steps"], d["steps_per_generation"],
            d["gradient_checkpointing"], d["max_steps"], d["save_steps"]) == (8, 16, 64, True, 80, 40)
    assert {k: v for k, v in d.items() if k not in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                     "steps_per_generation", "gradient_checkpointing")} == \
        {k: v for k, v in kw.items() if k not in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                  "steps_per_generation", "gradient_checkpointing")}
    with pytest.raises(mapping.MappingError, match="variant 'best'"):
        mapping.trl_kwargs(cfg, 20, "/o", variant="best")
    with pytest.raises(mapping.MappingError, match="mini_batches"):
        mapping.geometry(recipe_cfg("--trainer.mini_batches", "3"))


def test_peer_micro_batch_is_the_largest_padded_cut_within_the_token_budget():
    # the recipe: rows padded to 320 + 512 = 832; 16 x 832 = 13,312 <= 16,384 < 32 x 832 (and 19, 20 do not divide 128)
    assert mapping.peer_micro_batch(recipe_cfg(), 128) == 16
    assert mapping.peer_micro_batch(recipe_cfg("--trainer.micro_batch_tokens", "53248"), 128) == 64
    assert mapping.peer_micro_batch(recipe_cfg("--trainer.micro_batch_tokens", "53248", "--trainer.micro_batch_size", "32"), 128) == 32
    assert mapping.peer_micro_batch(recipe_cfg("--trainer.micro_batch_tokens", "0", "--trainer.micro_batch_size", "8"), 128) == 8
    with pytest.raises(mapping.MappingError, match="not a multiple of trainer.micro_batch_size 24"):
        mapping.peer_micro_batch(recipe_cfg("--trainer.micro_batch_tokens", "0", "--trainer.micro_batch_size", "24"), 128)
    with pytest.raises(mapping.MappingError, match="micro_batch_tokens 800 holds no padded row of 832"):
        mapping.peer_micro_batch(recipe_cfg("--trainer.micro_batch_tokens", "800"), 128)


def test_verl_overrides_carry_the_recipe_values():
    cfg = recipe_cfg()
    o = mapping.verl_overrides(cfg, "/d", 20, "/o", model_path="/m")
    keys = [x.split("=")[0].lstrip("+") for x in o]
    assert len(keys) == len(set(keys)), "an override given twice"
    for want in ["data.train_batch_size=64", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                 "actor_rollout_ref.actor.optim.lr=3e-06", "data.max_prompt_length=320", "data.max_response_length=512",
                 "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
                 "actor_rollout_ref.model.path=/m", "data.shuffle=False", "trainer.total_training_steps=20",
                 "actor_rollout_ref.model.use_remove_padding=False", "actor_rollout_ref.rollout.max_num_seqs=512",
                 "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=False"]:
        assert want in o, want
    graphs = [x for x in o if "cuda_graph_bs_decode" in x][0]
    assert graphs.endswith("=[1,2,4,8,16,24,32,48,64,96,128,160,192,224,256,320,384,448,512]")
    best = mapping.verl_overrides(cfg, "/d", 20, "/o", "best")
    assert "actor_rollout_ref.model.use_remove_padding=True" in best and "actor_rollout_ref.actor.use_dynamic_bsz=True" in best
    assert not any("attn_implementation=sdpa" in x for x in best)
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384" in best
    assert "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384" in best
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=True" in mapping.verl_overrides(cfg, "/d", 20, "/o", "defaults")


def test_readme_shows_the_generated_table_and_overrides():
    readme = open(os.path.join(ROOT, "tools", "peers", "README.md")).read()
    assert mapping.table_markdown() in readme
    cfg = recipe_cfg("--model.path", "/tmp/qwen2.5-coder-0.5b-instruct")
    o = mapping.verl_overrides(cfg, "/tmp/peers/data", 20, "/tmp/peers/verl_mapped")
    assert "```\n" + "\n".join(o).replace(ROOT, "<repo>") + "\n```" in readme


def test_slime_flags_carry_the_recipe_values():
    """mapping.slime_args: one SLIME_TABLE row per TABLE row; the recipe's geometry and values in slime's flags; the
    model's shape from its config.json (the recipe's GGUF-converted model is untied: slime's checker compares)."""
    assert [r[0] for r in mapping.SLIME_TABLE] == [r[0] for r in mapping.TABLE]
    assert all(len(row) == 3 and all(row) for row in mapping.SLIME_TABLE)
    cfg = recipe_cfg("--model.path", os.path.join(ROOT, "configs", "models", "qwen2.5-coder-0.5b"))
    flags = mapping.slime_args(cfg, "/d", 20, "/o")
    assert all(f.startswith("--") for f in flags)
    names = [f.split()[0] for f in flags]
    assert len(names) == len(set(names)), "a flag given twice"
    val = {f.split()[0]: " ".join(f.split()[1:]) for f in flags}
    assert (val["--num-rollout"], val["--rollout-batch-size"], val["--n-samples-per-prompt"], val["--global-batch-size"]) \
        == ("20", "64", "8", "128")
    assert (val["--eps-clip"], val["--eps-clip-high"], val["--lr"], val["--kl-coef"], val["--rollout-temperature"]) \
        == ("0.2", "0.28", "3e-06", "0.0", "0.7")
    assert (val["--max-tokens-per-gpu"], val["--rollout-max-response-len"], val["--rollout-max-prompt-len"]) \
        == ("16384", "512", "320")
    assert (val["--num-layers"], val["--hidden-size"], val["--num-query-groups"], val["--vocab-size"]) \
        == ("24", "896", "2", "151936")
    assert "--untie-embeddings-and-output-weights" in val and "--use-kl-loss" not in val and "--colocate" in val
    assert val["--sglang-cuda-graph-bs-decode"].split()[-1] == "512" and val["--sglang-attention-backend"] == "triton"
    assert val["--prompt-data"] == "/d/train.jsonl" and val["--save-hf"] == "/o/hf/rollout_{rollout_id}"
    module, func = val["--custom-rm-path"].rsplit(".", 1)
    assert module == "peer_reward" and callable(getattr(peer_reward, func))
    tied = mapping.slime_args(cfg, "/d", 20, "/o", hf_config=os.path.join(ROOT, "configs", "models", "tiny-qwen2",
                                                                          "config.json"))
    assert "--untie-embeddings-and-output-weights" not in tied and "--hidden-size 128" in tied
    with pytest.raises(mapping.MappingError, match="qwen2 shape only"):
        mapping.slime_model_args({"model_type": "llama"})


def test_next_md_shows_the_generated_slime_table():
    with open(os.path.join(ROOT, "tools", "peers", "NEXT.md")) as f:
        assert mapping.slime_table_markdown() in f.read()


def test_verl_validates_the_three_variants(tmp_path, capsys):
    pytest.importorskip("hydra")
    pytest.importorskip("ray")
    import importlib.util
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not importable")
    import verl_compose
    cfg = recipe_cfg("--model.path", "/m")
    for v in mapping.VARIANTS:
        f = tmp_path / f"{v}.txt"
        f.write_text("\n".join(mapping.verl_overrides(cfg, "/d", 20, "/o", v)))
        assert verl_compose.main([str(f), "--out", str(tmp_path / f"{v}.yaml")]) == 0
        assert "validated" in capsys.readouterr().out
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join([x for x in mapping.verl_overrides(cfg, "/d", 20, "/o") if "log_prob_micro" not in x]))
    assert verl_compose.main([str(bad)]) == 1
    assert "log_prob_micro_batch_size" in capsys.readouterr().err


def test_slime_parser_accepts_the_mapped_flags(tmp_path):
    """slime_check.py: the mapped flags through slime's own parse_args (runs only where slime, its Megatron-LM and
    SGLang import: tools/peers/NEXT.md, B, names the environment); an unknown flag and a tied/untied mismatch refused."""
    import importlib.util
    for mod in ("slime", "sglang", "sglang_router", "megatron.training", "ray", "wandb"):
        if importlib.util.find_spec(mod.split(".")[0]) is None:
            pytest.skip(f"{mod} is not importable")
    cfg = recipe_cfg("--model.path", os.path.join(ROOT, "configs", "models", "qwen2.5-coder-0.5b"))
    flags = mapping.slime_args(cfg, "/d", 20, "/o")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tools", "peers"), os.environ.get("PYTHONPATH", "")]))
    run = lambda lines: subprocess.run([sys.executable, "tools/peers/slime_check.py", "-"], input="\n".join(lines),
                                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    r = run(flags)
    assert r.returncode == 0 and r.stdout.strip().endswith("parsed"), r.stderr[-2000:]
    r = run(flags + ["--bogus-flag 3"])
    assert r.returncode == 2 and "ignore flags they do not know: --bogus-flag" in r.stderr
    r = run([f for f in flags if "untie" not in f])
    assert r.returncode == 2 and "tie_word_embeddings" in r.stderr


def test_trl_grpo_two_steps_on_the_tiny_cpu_model(tmp_path):
    trl = pytest.importorskip("trl")
    cfg = tmp_path / "trl.yaml"
    train = tmp_path / "train.jsonl"
    with open(train, "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n")
    cfg.write_text(yaml.safe_dump({
        "model": {"config": "configs/models/tiny-qwen2", "tokenizer": "assets/tiny-tokenizer", "dtype": "float32"},
        "data": {"path": str(train), "system_prompt": "Reason step by step.", "max_prompt_len": 320},
        "grpo": {"n_samples": 4, "temperature": 0.7}, "rollout": {"batch_size": 4, "max_new_tokens": 8},
        "trainer": {"lr": 3.0e-6, "micro_batch_size": 4, "mini_batches": 2}}))
    data = tmp_path / "data"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(os.path.dirname(trl.__file__)), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "tools/peers/peer_data.py", "--config", str(cfg), "--steps", "2", "--out_dir", str(data)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "tools/peers/trl_grpo.py", "--config", str(cfg), "--data", str(data / "train.jsonl"),
                        "--steps", "2", "--out_dir", str(out), "--run", "cpu-smoke", "--save_every", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    recs = list(schema.read(str(out / "trl_steps.jsonl")))
    assert [r["kind"] for r in recs] == ["startup", "step", "step"]
    s1, s2 = recs[1], recs[2]
    assert (s1["step"], s2["step"], s1["optimizer_steps"], s2["optimizer_steps"]) == (1, 2, 2, 4)
    assert s1["rows_in_order"] and s2["rows_in_order"] and s2["rows"] == [4, 7]
    for s in (s1, s2):
        assert s["rollout_s"] > 0 and s["pi_old_s"] > 0 and s["update_s"] > 0 and s["sync_s"] == 0.0
        assert s["tokens"] > 4 * 4 * 8 and s["train_s"] == pytest.approx(s["pi_old_s"] + s["update_s"])
        assert s["rollout_s"] + s["reward_s"] + s["pi_old_s"] + s["update_s"] <= s["step_s"] * 1.0001
    assert (out / "checkpoint-2" / "config.json").exists() and (out / "checkpoint-4" / "config.json").exists()
