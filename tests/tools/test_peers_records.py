"""tools/peers' data, reward and records (issue 39 point 1): peer_data.py writes megaforge's prompt order for the
peers (parquet for verl, jsonl for TRL and slime); peer_reward.py puts megaforge's math reward behind verl's, TRL's and
slime's signatures; parse_logs.py turns megaforge's metrics, verl's file logger / console lines and evaluate.py's
output into schema.py's records (bad records refused); compare.py's ratios within a hold, time to target, plot and
McNemar test on per-prompt grades. tools/peers is on sys.path through tests/tools/conftest.py."""
import json
import os

import pytest
import yaml

import compare
import parse_logs
import peer_data
import peer_reward
import schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_slime_reward_adapter_is_megaforge_math_reward():
    import asyncio
    from types import SimpleNamespace
    right = SimpleNamespace(response="so the total is \\boxed{1,000}.", label="1000")
    wrong = SimpleNamespace(response="\\boxed{999}", label="1000")
    assert asyncio.run(peer_reward.slime_math_reward(None, right)) == 1.0
    assert asyncio.run(peer_reward.slime_math_reward(None, wrong, evaluation=True)) == 0.0


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
