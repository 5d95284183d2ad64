"""tools/peers (issue 39 point 1): the recipe's keys all mapped to verl's and TRL's, megaforge's prompt order
written for the peers, megaforge's math reward behind their signatures, their logs parsed into one schema,
the comparison's ratios and plot, and TRL's GRPOTrainer for 2 steps on the tiny CPU model."""
import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "peers"))

import compare  # noqa: E402
import mapping  # noqa: E402
import parse_logs  # noqa: E402
import peer_data  # noqa: E402
import peer_reward  # noqa: E402
import schema  # noqa: E402

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
                 "trl_steps_per_generation": 32, "updates": 4, "micro_batch": 16}
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


def tiny_data(tmp_path, n=10):
    train = tmp_path / "train.jsonl"
    with open(train, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n")
    test = tmp_path / "test.jsonl"
    with open(test, "w") as f:
        for i in range(3):
            f.write(json.dumps({"prompt": f"What is {i} times 3?", "answer": str(3 * i)}) + "\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"config": "configs/models/tiny-qwen2", "tokenizer": "assets/tiny-tokenizer"},
        "data": {"path": str(train), "system_prompt": "Reason step by step.", "max_prompt_len": 320},
        "rollout": {"batch_size": 4}, "eval": {"sets": [{"name": "t", "path": str(test)}], "interval": 10}}))
    return cfg


def test_data_follows_megaforge_prompt_order_across_epochs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg_path = tiny_data(tmp_path)
    from megaforge.config import load_config
    from megaforge.data.prompts import PromptSource
    from megaforge.hf import load_tokenizer
    cfg = load_config(["--config", str(cfg_path)])
    tok = load_tokenizer(cfg.model)
    rows = peer_data.ordered_rows(cfg, tok, 5)  # 20 prompts of 10 rows: epochs 0, 1 and part of 2
    src = PromptSource(cfg.data, tok, cfg.seed)
    want = [r.where for _ in range(5) for r in src.next_batch(4)]
    assert [r["where"] for r in rows] == want
    assert [r["where"] for r in rows[:10]] != [f"{cfg.data.path}:{i}" for i in range(1, 11)], "shuffled, as megaforge's"
    assert [r["step"] for r in rows] == [s for s in range(1, 6) for _ in range(4)]
    assert rows[0]["messages"][0] == {"role": "system", "content": "Reason step by step."}
    out = tmp_path / "out"
    assert peer_data.main(["--config", str(cfg_path), "--steps", "5", "--out_dir", str(out)]) == 0
    import pyarrow.parquet as pq
    t = pq.read_table(out / "train.parquet").to_pylist()
    assert [r["extra_info"]["where"] for r in t] == want and len(pq.read_table(out / "test.parquet")) == 3
    first = t[0]
    assert first["reward_model"] == {"style": "rule", "ground_truth": rows[0]["label"]} and first["data_source"] == "gsm8k"
    lines = [json.loads(x) for x in open(out / "train.jsonl")]
    assert [x["where"] for x in lines] == want and lines[0]["prompt"] == rows[0]["messages"]


def test_reward_adapters_are_megaforge_math_reward():
    assert peer_reward.compute_score("gsm8k", "so the total is \\boxed{1,000}.", "1000") == 1.0
    assert peer_reward.compute_score("gsm8k", "so the total is \\boxed{999}.", "1000", extra_info={"x": 1}, other=2) == 0.0
    assert peer_reward.compute_score("gsm8k", "no answer here", "1000") == 0.0
    comps = [[{"role": "assistant", "content": "\\boxed{4}"}], [{"role": "assistant", "content": "\\boxed{5}"}], "#### 5"]
    assert peer_reward.trl_math_reward(prompts=[None] * 3, completions=comps, answer=["4", "4", "5"],
                                       completion_ids=[[1]] * 3) == [1.0, 0.0, 1.0]


def write_lines(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_megaforge_metrics_become_schema_records(tmp_path):
    m = write_lines(tmp_path / "metrics.jsonl", [
        {"step": 0, "eval/gsm8k_test/greedy/pass@1": 0.27, "eval/gsm8k_test/prompts": 1319.0, "time/eval": 20.0},
        {"step": 1, "time/rollout": 3.0, "time/reward_wait": 0.1, "time/train": 11.0, "time/release": 0.1, "time/onload": 0.2,
         "time/offload": 0.3, "time/resume": 0.1, "time/sync": 0.3, "time/step": 16.0, "throughput/tokens_per_s": 1000.0},
        {"step": 2, "time/rollout": 2.0, "time/train": 10.0, "time/train/pi_old": 2.5, "time/train/update": 7.0,
         "time/sync": 0.5, "time/step": 14.0, "throughput/tokens_per_s": 2000.0}])
    stamps = write_lines(tmp_path / "stamps", [{"line": 1, "t": 150.0}, {"line": 2, "t": 170.0}, {"line": 3, "t": 184.0}])
    recs = parse_logs.megaforge_records(m, "hold1", stamps=parse_logs.read_stamps(stamps), launch_t=100.0)
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["sync_s"] == pytest.approx(1.0) and steps[0]["tokens"] == 16000.0
    assert steps[0]["tokens_per_s_per_gpu"] == pytest.approx(1000.0) and steps[0]["pi_old_s"] is None
    assert steps[0]["first"] and not steps[1]["first"] and steps[1]["train_wall_s"] == 30.0
    assert (steps[1]["pi_old_s"], steps[1]["update_s"]) == (2.5, 7.0)  # time/train's parts (step 1's log has none)
    (ev,) = [r for r in recs if r["kind"] == "eval"]
    assert ev["pass1"] == 0.27 and ev["step"] == 0
    (st,) = [r for r in recs if r["kind"] == "startup"]
    assert st["startup_s"] == pytest.approx(170.0 - 16.0 - 100.0) and "eval" in st["includes"]


def verl_fixture(tmp_path):
    d1 = {"timing_s/step": 30.0, "timing_s/gen": 8.0, "timing_s/reward": 0.5, "timing_s/old_log_prob": 4.0,
          "timing_s/update_actor": 14.0, "timing_s/update_weights": 2.0, "perf/total_num_tokens": 300000,
          "perf/throughput": 10000.0, "training/global_step": 1}
    d2 = dict(d1, **{"timing_s/step": 33.0, "timing_s/save_checkpoint": 5.0})
    return write_lines(tmp_path / "verl.jsonl", [
        {"step": 0, "data": {"val-core/gsm8k/acc/mean@1": 0.26}},
        {"step": 1, "data": d1}, "some other line", {"step": 2, "data": d2}])


def test_verl_file_logger_and_console_lines_become_schema_records(tmp_path):
    recs = parse_logs.verl_records(verl_fixture(tmp_path), "hold2-mapped")
    s1, s2 = [r for r in recs if r["kind"] == "step"]
    assert (s1["rollout_s"], s1["pi_old_s"], s1["update_s"], s1["train_s"], s1["sync_s"]) == (8.0, 4.0, 14.0, 18.0, 2.0)
    assert s1["tokens_per_s_per_gpu"] == pytest.approx(10000.0)  # verl's own perf/throughput
    assert s2["step_s"] == 28.0, "verl's checkpoint is timed inside its step: taken out"
    assert [r["pass1"] for r in recs if r["kind"] == "eval"] == [0.26]
    console = write_lines(tmp_path / "console.log", [
        "(TaskRunner pid=1) step:1 - timing_s/step:30.0 - timing_s/gen:8.0 - timing_s/old_log_prob:4.0 - "
        "timing_s/update_actor:14.0 - timing_s/update_weights:2.0 - perf/total_num_tokens:300000 - actor/pg_loss:np.float64(0.1)"])
    (c,) = parse_logs.verl_records(console, "hold2-mapped")
    assert (c["step_s"], c["train_s"], c["tokens"]) == (30.0, 18.0, 300000.0)


def test_evaluate_output_becomes_eval_records(tmp_path):
    f = write_lines(tmp_path / "ev.log", ["[evaluate] loading", {"eval/gsm8k_test/greedy/pass@1": 0.31, "eval/gsm8k_test/prompts": 1319.0}])
    (r,) = parse_logs.evaluate_records(f, "verl", "hold2-mapped", 10)
    assert (r["system"], r["step"], r["pass1"], r["source"]) == ("verl", 10, 0.31, "tools/evaluate.py")


def test_schema_refuses_bad_records(tmp_path):
    bad = write_lines(tmp_path / "bad.jsonl", [{"kind": "step", "system": "verl", "run": "h", "step": 1, "step_s": -1.0, "n_gpus": 1}])
    with pytest.raises(schema.SchemaError, match="bad.jsonl:1: step_s"):
        list(schema.read(bad))
    with pytest.raises(schema.SchemaError, match="system 'slime'"):
        schema.check({"kind": "startup", "system": "slime", "startup_s": 1.0})


def mf_steps(run, times, **kw):
    return [schema.step_record("megaforge", run, i + 1, step_s=t, tokens=1000.0 * t, first=i == 0, **kw) for i, t in enumerate(times)]


def test_compare_ratios_within_a_hold_and_png(tmp_path, capsys):
    mf = schema.with_wall(mf_steps("hold1", [40.0, 10.0, 12.0, 10.0], rollout_s=3.0, train_s=6.0, sync_s=1.0)
                          + [{"kind": "eval", "system": "megaforge", "run": "hold1", "step": s, "pass1": p, "source": "tools/evaluate.py"}
                             for s, p in [(0, 0.26), (2, 0.30), (4, 0.33)]]
                          + [{"kind": "startup", "system": "megaforge", "run": "hold1", "startup_s": 150.0}])
    verl = schema.with_wall([schema.step_record("verl", "hold1-mapped", i + 1, step_s=t, rollout_s=8.0, pi_old_s=4.0, update_s=16.0,
                                                sync_s=2.0, tokens=10000.0) for i, t in enumerate([90.0, 30.0, 30.0, 32.0])]
                            + [{"kind": "eval", "system": "verl", "run": "hold1-mapped", "step": s, "pass1": p, "source": "tools/evaluate.py"}
                               for s, p in [(0, 0.26), (4, 0.30)]])
    trl = schema.with_wall([schema.step_record("trl", "hold2-mapped", 1, step_s=100.0, tokens=1e5)])
    files = [tmp_path / "mf.jsonl", tmp_path / "verl.jsonl", tmp_path / "trl.jsonl"]
    for f, recs in zip(files, [mf, verl, trl]):
        schema.write(recs, str(f))
    png = tmp_path / "curves.png"
    summ = tmp_path / "summary.jsonl"
    assert compare.main([str(f) for f in files] + ["--png", str(png), "--json", str(summ), "--provenance", "[1]"]) == 2
    assert "--provenance: not a JSON object" in capsys.readouterr().err
    prov = '{"commit": "abc", "device": "NVIDIA H200"}'
    assert compare.main([str(f) for f in files] + ["--png", str(png), "--json", str(summ), "--provenance", prov]) == 0
    out = capsys.readouterr().out
    rows = {r["system"]: r for r in map(json.loads, open(summ))}
    assert all(r["provenance"] == json.loads(prov) for r in rows.values())
    v = rows["verl"]
    assert v["ratio/step_s"] == pytest.approx(10.0 / 30.0)  # medians after the first step: 10 vs 30
    assert v["ratio/rollout_s"] == pytest.approx(3.0 / 8.0) and v["ratio/train_s"] == pytest.approx(6.0 / 20.0)
    # the same 10,000 tokens a step: 1,000 tok/s against 333: for a rate the ratio is peer / megaforge (below 1 = megaforge wins)
    assert v["ratio/tokens_per_s_per_gpu"] == pytest.approx((10000.0 / 30.0) / 1000.0)
    assert v["first_step_s"] == 90.0 and rows["megaforge"]["startup_s"] == 150.0
    # verl reaches 0.30 at its step 4 (30 + 30 + 32 s after the first 90 = 182 s); megaforge at step 2 (50 s)
    assert v["target_pass1"] == 0.30 and v["peer_s_to_target"] == 182.0 and v["megaforge_s_to_target"] == 50.0
    assert "ratio/step_s" not in rows["trl"] and "no megaforge run in this hold" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "2 curves" in out


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


def test_readme_shows_the_generated_table_and_overrides():
    readme = open(os.path.join(ROOT, "tools", "peers", "README.md")).read()
    assert mapping.table_markdown() in readme
    cfg = recipe_cfg("--model.path", "/tmp/qwen2.5-coder-0.5b-instruct")
    o = mapping.verl_overrides(cfg, "/tmp/peers/data", 20, "/tmp/peers/verl_mapped")
    assert "```\n" + "\n".join(o).replace(ROOT, "<repo>") + "\n```" in readme


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


def _samples(path, correct, prompts=None):
    with open(path, "w") as f:
        for i, c in enumerate(correct):
            f.write(json.dumps({"set": "t", "prompt_index": i, "mode": "greedy", "sample": 0,
                                "prompt": (prompts or {}).get(i, f"q{i}"), "correct": c}) + "\n")
            f.write(json.dumps({"set": "t", "prompt_index": i, "mode": "sampled", "sample": 1, "prompt": f"q{i}",
                                "correct": not c}) + "\n")  # sampled lines are not counted


def test_mcnemar_exact_on_discordant_pairs_and_refuses_other_prompts(tmp_path, capsys):
    # a right on prompts 0-3, b right on 2-8: 2 right only for a, 5 only for b; p = 2 (C(7,0)+C(7,1)+C(7,2)) / 2^7
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _samples(a, [i < 4 for i in range(12)])
    _samples(b, [2 <= i < 9 for i in range(12)])
    assert compare.main(["--mcnemar", str(a), str(b)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["only_a"], r["only_b"], r["prompts"]) == (2, 5, 12)
    assert r["p_value"] == pytest.approx(2 * (1 + 7 + 21) / 128)
    assert r["a_pass1"] == pytest.approx(4 / 12) and r["b_pass1"] == pytest.approx(7 / 12)
    _samples(b, [True] * 12, prompts={3: "another question"})
    assert compare.main(["--mcnemar", str(a), str(b)]) == 2
    assert "prompt ('t', 3) differs" in capsys.readouterr().err
    _samples(b, [True] * 11)
    assert compare.main(["--mcnemar", str(a), str(b)]) == 2
    assert "1 only in" in capsys.readouterr().err


def test_mcnemar_on_run4s_step0_and_step50_evaluations(capsys):
    # the committed per-prompt files of run 4 (H200, f881733): 352 and 478 of 1,319 right
    d = os.path.join(ROOT, "docs", "benchmarks")
    assert compare.main(["--mcnemar", os.path.join(d, "grpo_gsm8k_run4_eval_step0.jsonl.gz"),
                         os.path.join(d, "grpo_gsm8k_run4_eval_step50.jsonl.gz")]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompts"] == 1319 and round(r["a_pass1"] * 1319) == 352 and round(r["b_pass1"] * 1319) == 478
    assert r["only_b"] > r["only_a"] and r["p_value"] < 1e-6
    # an in-run evaluation (set "gsm8k_test") beside evaluate.py's grade (set "test") of the same rows: matched by
    # the rows' source (where); hold 2's step 50 (H100) against run 4's: 0.343 vs 0.362, not significant
    assert compare.main(["--mcnemar", os.path.join(d, "grpo_gsm8k_run4_eval_step50.jsonl.gz"),
                         os.path.join(d, "peers_h100_hold2_eval_megaforge_50_samples.jsonl.gz")]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompts"] == 1319 and (r["only_a"], r["only_b"]) == (176, 151) and r["p_value"] > 0.05


def test_time_to_target_from_in_run_grades_is_a_separate_cross_check(tmp_path, capsys):
    # megaforge graded by evaluate.py only at step 0; its in-run evaluation at step 2 reaches verl's step-4 pass@1
    mf = schema.with_wall(mf_steps("hold1", [40.0, 10.0, 12.0])
                          + [{"kind": "eval", "system": "megaforge", "run": "hold1", "step": 0, "pass1": 0.26, "source": "tools/evaluate.py"},
                             {"kind": "eval", "system": "megaforge", "run": "hold1", "step": 2, "pass1": 0.31, "source": "megaforge-eval"}])
    verl = schema.with_wall([schema.step_record("verl", "hold1-mapped", i + 1, step_s=30.0, tokens=1e4) for i in range(4)]
                            + [{"kind": "eval", "system": "verl", "run": "hold1-mapped", "step": 4, "pass1": 0.30, "source": "tools/evaluate.py"}])
    files = [tmp_path / "mf.jsonl", tmp_path / "verl.jsonl"]
    for f, recs in zip(files, [mf, verl]):
        schema.write(recs, str(f))
    summ = tmp_path / "s.jsonl"
    assert compare.main([str(f) for f in files] + ["--json", str(summ)]) == 0
    v = [r for r in map(json.loads, open(summ)) if r["system"] == "verl"][0]
    assert v["megaforge_s_to_target"] is None and v["ratio/time_to_target"] is None  # never mixed into the ratio
    assert v["cross_check/megaforge_s_to_target"] == 50.0 and v["cross_check/ratio/time_to_target"] == pytest.approx(50.0 / 120.0)
    assert "in-run cross-check: 0.417" in capsys.readouterr().out


def test_h200_peers_evaluate_shares_one_engine_start_and_falls_back_to_one_alone(tmp_path):
    """h200_peers.sh's evaluate on the CPU (embedded engine, tiny models, the demo config in place of the
    recipe): the models share one tools/evaluate.py call; a model missing from its output (here: another
    architecture, refused after the first was graded) is evaluated alone; a missing folder is skipped."""
    from tests.conftest import make_tiny_model

    a = make_tiny_model(str(tmp_path / "a"), seed=1)
    wide = make_tiny_model(str(tmp_path / "wide"), seed=1, intermediate_size=96)
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Compute {x} times 7.", "answer": str(7 * x)}) + "\n" for x in range(2)))
    env = dict(os.environ, OUT=str(tmp_path / "out"), PEERS_DIR=str(tmp_path / "p"), RECIPE="configs/demo_cpu.yaml",
               EVAL_DATA=str(data), ENGINE_ENV_JSON="{}", MF_PATH=ROOT, OMP_NUM_THREADS="1",
               EVAL_FLAGS="--rollout.max_new_tokens 4 --data.max_prompt_len 64 --k 0 --eval.check_disjoint false")
    script = (f'source tools/peers/h200_peers.sh; evaluate "s 20 {a} verl:h1-v" "s 10 {tmp_path}/none verl:h1-v" '
              f'"w 0 {wide} verl:h1-v,megaforge:h1"')
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"no HF folder at {tmp_path}/none" in r.stdout
    assert f"{wide}: not in the shared call's output; evaluated alone" in r.stdout
    out = tmp_path / "out"
    s20 = [json.loads(x) for x in open(out / "eval_s_20.jsonl")]
    w0 = [json.loads(x) for x in open(out / "eval_w_0.jsonl")]
    assert [(e["system"], e["run"], e["step"], e["prompts"]) for e in s20] == [("verl", "h1-v", 20, 2.0)]
    assert [(e["system"], e["run"], e["step"]) for e in w0] == [("verl", "h1-v", 0), ("megaforge", "h1", 0)]
    assert (out / "eval_s_20_samples.jsonl.gz").stat().st_size > 0 and (out / "eval_w_0_samples.jsonl.gz").stat().st_size > 0
    log = next(out.glob("eval_*.log")).read_text()
    assert "config.json intermediate_size" in log  # the shared call's refusal of the second model, then its own call


def test_h200_peers_megaforge_flags_pass_the_recipe_config_check():
    """mf_start's launcher flags, as the GPU machine gets them, through the recipe's --dry_run (the config checks
    a run makes before it starts). Hold 2 lost a launch to a flag set the config refuses (eval.sets never
    evaluated: eval.interval 0 with eval.before_train false); this catches that on the CPU."""
    env = dict(os.environ, MF_STEPS="50", MF_EXPORT_EVERY="10", OUT="/tmp/h200-peers-flags-out",
               PEERS_DIR="/tmp/h200-peers-flags")
    flags = subprocess.run(["bash", "-c", "source tools/peers/h200_peers.sh; mf_flags"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert flags.returncode == 0, flags.stderr
    argv = flags.stdout.split()
    assert argv[argv.index("--max_steps") + 1] == "50" and argv[argv.index("--export_hf_every") + 1] == "10"
    r = subprocess.run([sys.executable, "launchers/grpo.py", *argv, "--dry_run", "--model_config",
                        "configs/models/qwen2.5-coder-0.5b", "--gpus_per_node", "1", "--gpu", "H200",
                        "--memory.offload", "auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "memory.offload auto -> none" in r.stdout


def _wheel(folder, dist: str, version: str, tag: str = "py3-none-any", module: str | None = None) -> str:
    """A minimal installable wheel ``dist-version-tag.whl`` with one module (``__version__`` = version)."""
    import zipfile
    name = dist.replace("-", "_")
    path = os.path.join(str(folder), f"{name}-{version}-{tag}.whl")
    info = f"{name}-{version}.dist-info"
    files = {f"{module or name}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def test_h200_peers_vllm_kit_joins_the_parts_and_takes_the_sglang_kits_wheels(tmp_path):
    """h200_peers.sh's vllm_kit install on the CPU, with stand-in wheels laid out as prepare_vllm.sh lays out
    .carry/vllm (the vLLM wheel in parts, vllm-deps, SHA256SUMS) and the SGLang kit's /tmp/sgl holding the
    [kit] pins of tools/peers/wheels_vllm.txt: it refuses a missing part and a missing kit wheel, joins the parts
    in order, installs everything into VLLM_SITE and writes env.sh."""
    import hashlib
    lines = [ln for ln in open(os.path.join(ROOT, "tools", "peers", "wheels_vllm.txt")) if "==" in ln.split("#")[0]]
    pins = [ln.split("#")[0].strip() for ln in lines]
    kit = [ln.split("#")[0].strip() for ln in lines if "[kit]" in ln]
    assert "vllm==0.26.0" in pins and "xgrammar==0.2.1" in kit and "pydantic-core==2.50.5" in kit
    vk, sgl, site, build = tmp_path / "vk", tmp_path / "sgl", tmp_path / "site", tmp_path / "build"
    for d in (vk / "vllm-deps", sgl, build):
        d.mkdir(parents=True)
    big = _wheel(build, "vllm", "0.26.0", "cp38-abi3-manylinux_2_28_x86_64")
    data = open(big, "rb").read()
    name = os.path.basename(big)
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    sums = [f"{hashlib.sha256(data).hexdigest()}  {name}\n"]
    for k in range(3):
        (vk / f"vllm-part{k + 1}").mkdir()
        part = vk / f"vllm-part{k + 1}" / f"{name}.part_0{k}"
        part.write_bytes(data[cut[k]:cut[k + 1]])
        sums.append(f"{hashlib.sha256(part.read_bytes()).hexdigest()}  vllm-part{k + 1}/{part.name}\n")
    dep = _wheel(vk / "vllm-deps", "cloudpickle", "3.1.3")
    sums.append(f"{hashlib.sha256(open(dep, 'rb').read()).hexdigest()}  vllm-deps/{os.path.basename(dep)}\n")
    (vk / "SHA256SUMS").write_text("".join(sums))
    for req in kit:
        dist, version = req.split("==")
        _wheel(sgl, dist.lower(), version, module=f"kit_{dist.replace('-', '_')}")
    env = dict(os.environ, OUT=str(tmp_path / "out"), PEERS_DIR=str(tmp_path / "p"), VLLM_KIT=str(vk),
               VLLM_SITE=str(site), SGL_WHEELS=str(sgl))
    run = lambda: subprocess.run(["bash", "-c", "source tools/peers/h200_peers.sh; vllm_kit"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300)
    part3 = vk / "vllm-part3" / f"{name}.part_02"
    part3.rename(tmp_path / "away")
    r = run()
    assert r.returncode != 0 and f"vllm_kit: 2 of 3 parts under {vk}" in r.stdout
    (tmp_path / "away").rename(part3)
    moved = next(sgl.glob("xgrammar-0.2.1-*.whl"))
    moved.rename(tmp_path / moved.name)
    r = run()
    assert r.returncode != 0 and f"vllm_kit: xgrammar==0.2.1 not in {sgl}" in r.stdout
    (tmp_path / moved.name).rename(moved)
    r = run()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"vllm_kit: {name} + 1 wheels + {len(kit)} of the SGLang kit's into {site}" in r.stdout
    assert (site / "vllm" / "__init__.py").read_text() == "__version__ = '0.26.0'\n"
    assert (site / "cloudpickle").is_dir() and (site / "kit_xgrammar").is_dir() and (site / "kit_pydantic_core").is_dir()
    assert not (vk / name).exists()  # the joined wheel is removed once installed
    assert "VLLM_NO_USAGE_STATS=1" in (vk / "env.sh").read_text()


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


def test_slime_reward_adapter_is_megaforge_math_reward():
    import asyncio
    from types import SimpleNamespace
    right = SimpleNamespace(response="so the total is \\boxed{1,000}.", label="1000")
    wrong = SimpleNamespace(response="\\boxed{999}", label="1000")
    assert asyncio.run(peer_reward.slime_math_reward(None, right)) == 1.0
    assert asyncio.run(peer_reward.slime_math_reward(None, wrong, evaluation=True)) == 0.0


def test_next_md_shows_the_generated_slime_table():
    with open(os.path.join(ROOT, "tools", "peers", "NEXT.md")) as f:
        assert mapping.slime_table_markdown() in f.read()


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
