"""tools/evaluate.py: one JSON line with a run's metric keys and a per-sample file, from an HF folder or
a run checkpoint; on a run's checkpoint it reproduces the evaluation the run logged at that step.
The tool runs in this process (its ``main``, as the script calls it), from the repository root."""
import importlib.util
import json
import os
import sys

import pytest
import torch

from eval_helpers import EVAL, ROOT, eval_part, launch, launch_here, samples

sys.path.insert(0, os.path.join(ROOT, "tools"))  # as when run as a script: its folder's common.py
_spec = importlib.util.spec_from_file_location("megaforge_evaluate_tool", os.path.join(ROOT, "tools", "evaluate.py"))
TOOL = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(TOOL)


@pytest.fixture
def evaluate(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # a run's config.yaml holds paths relative to where it was started

    def run(*args, expect_rc=0):
        rc = TOOL.main(list(args))
        out, err = capsys.readouterr()
        assert rc == expect_rc, out[-3000:] + err[-3000:]
        return (json.loads(out.strip().splitlines()[-1]) if rc == 0 else None), err

    return run


def test_checkpoint_evaluation_equals_the_runs_own(tmp_path, evaluate):
    out = str(tmp_path)
    recs = launch_here(out, "r", "--max_steps", "2", "--eval.interval", "2", *EVAL)
    run = os.path.join(out, "r")
    got, _ = evaluate("--model", run, "--k", "4", "--out", str(tmp_path / "s.jsonl"), "--eval.pass_k", "[1, 2, 4]")
    assert got["weights"] == "step_000002" and got["engine"] == "embedded"
    logged = {k: v for k, v in eval_part(recs[2]).items() if k != "eval/weight_version"}
    assert {k: v for k, v in got.items() if k.startswith("eval/")} == logged
    tool_rows = samples(str(tmp_path / "s.jsonl"))
    run_rows = samples(os.path.join(run, "eval", "held", "step_000002.jsonl"))
    assert [r["response"] for r in tool_rows] == [r["response"] for r in run_rows]
    # the same checkpoint named directly; without --k the run's eval.n_samples (4) holds
    again, _ = evaluate("--model", os.path.join(run, "checkpoints", "step_000002"), "--max_rows", "2",
                        "--out", str(tmp_path / "two.jsonl"))
    assert again["eval/held/prompts"] == 2 and len(samples(str(tmp_path / "two.jsonl"))) == 2 * (1 + 4)


def test_hf_folder_and_a_data_file(tmp_path, tiny_model_dir, evaluate):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {a} + 1?", "a": str(a + 1)}) + "\n" for a in range(3)))
    got, _ = evaluate("--model", tiny_model_dir, "--data", str(data), "--input_key", "q", "--label_key", "a",
                      "--k", "2", "--out", str(tmp_path / "x.jsonl"), "--rollout.max_new_tokens", "6",
                      "--data.apply_chat_template", "false", "--data.max_prompt_len", "64")
    assert got["weights"] == "hf" and got["eval/sums/prompts"] == 3
    for k in ("greedy/pass@1", "sampled/pass@1", "sampled/pass@2", "greedy/reward/math", "sampled/response_len/mean"):
        assert f"eval/sums/{k}" in got, k
    rows = samples(str(tmp_path / "x.jsonl"))
    assert [r["mode"] for r in rows] == ["greedy"] * 3 + ["sampled"] * 6
    assert all(r["response_len"] <= 6 for r in rows) and rows[0]["label"] == "1"


def test_bad_model_and_bad_rows_are_named(tmp_path, tiny_model_dir, evaluate):
    _, err = evaluate("--model", str(tmp_path / "nope"), "--data", "x.jsonl", expect_rc=1)
    assert "--model" in err and "no such folder" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "What is 1 + 1?"}) + "\n")
    _, err = evaluate("--model", tiny_model_dir, "--data", str(bad), "--data.max_prompt_len", "64", expect_rc=1)
    assert "bad.jsonl:1: missing field 'answer'" in err and "Traceback" not in err



@pytest.mark.slow
def test_megatron_checkpoint_evaluation_equals_the_runs_own(tmp_path, evaluate):
    pytest.importorskip("megatron.core")
    out = str(tmp_path)
    recs = launch(out, "m", "--max_steps", "2", "--eval.interval", "2", "--trainer.backend", "megatron", *EVAL)
    # the checkpoint's dist shards -> tools/convert_megatron_to_hf.py -> an HF folder -> the same engine
    got, _ = evaluate("--model", os.path.join(out, "m"), "--out", str(tmp_path / "m.jsonl"))
    assert got["weights"] == "step_000002"
    logged = {k: v for k, v in eval_part(recs[2]).items() if k != "eval/weight_version"}
    assert {k: v for k, v in got.items() if k.startswith("eval/")} == logged
    assert 0.0 < logged["eval/held/sampled/pass@1"] < 1.0  # the comparison is not between two zeros


EVIL = '''import os
open(os.environ["MEGAFORGE_EVIL_MARKER"], "a").write("ran\\n")
from transformers import Qwen2Config, Qwen2ForCausalLM


class EvilConfig(Qwen2Config):
    pass


class EvilModel(Qwen2ForCausalLM):
    config_class = EvilConfig
'''


def _remote_code_run(tmp_path, tiny_model_dir):
    """A model folder whose config.json names its own module (``auto_map``: evil.py, which writes a
    marker when imported), a run folder whose config.yaml trusts it, and a complete checkpoint."""
    import shutil

    import torch

    from megaforge.checkpoint import write_manifest

    model = tmp_path / "evil-model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "evil.py").write_text(EVIL)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000001"
    (ckpt / "trainer").mkdir(parents=True)
    from transformers import AutoModelForCausalLM

    torch.save({"model": AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()},
               ckpt / "trainer" / "trainer.pt")
    (ckpt / "state.json").write_text(json.dumps({"phase": "rl", "step": 1}))  # REQUIRED_FILES of a checkpoint
    write_manifest(str(ckpt))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    (run / "config.yaml").write_text(
        f"model: {{path: {model}, trust_remote_code: true}}\n"
        f"data: {{path: {data}, max_prompt_len: 64}}\n"
        f"eval: {{sets: [{{name: d, path: {data}}}], check_disjoint: false, interval: 1}}\n")
    return model, run


def test_a_run_folder_cannot_make_evaluate_run_its_models_code(tmp_path, tiny_model_dir, evaluate, monkeypatch):
    """Issue 40 case 6: a run folder whose config.yaml trusts a model with an ``auto_map`` module got
    that module executed. Without evaluate's own --trust_remote_code, nothing of it is imported."""
    marker = tmp_path / "ran"
    monkeypatch.setenv("MEGAFORGE_EVIL_MARKER", str(marker))
    model, run = _remote_code_run(tmp_path, tiny_model_dir)
    _, err = evaluate("--model", str(run), "--rollout.max_new_tokens", "2", expect_rc=1)
    assert not marker.exists()
    err = err.splitlines()[-1]
    assert err.startswith(f"evaluate: error: --model {run}: {run}/config.yaml sets ") and "model.trust_remote_code true" in err \
        and "--trust_remote_code" in err.split("refused")[1], err
    # an HF folder evaluated under that config (--config), or the key given on the command line
    data = str(tmp_path / "d.jsonl")
    for extra in (["--config", str(run / "config.yaml")], ["--model.trust_remote_code", "true"]):
        _, err = evaluate("--model", str(model), "--data", data, "--data.max_prompt_len", "64",
                          "--rollout.max_new_tokens", "2", *extra, expect_rc=1)
        err = err.splitlines()[-1]
        base = extra[1] if extra[0] == "--config" else "the defaults"
        assert not marker.exists() and err.startswith(f"evaluate: error: --model {model}: the evaluation's config "
                                                      f"({base} and the command line) sets model.trust_remote_code "
                                                      f"true") and err.endswith("given --trust_remote_code"), err
    # asked for on evaluate's own command line: the model's code runs (what the flag allows)
    got, _ = evaluate("--model", str(model), "--data", data, "--data.max_prompt_len", "64",
                      "--rollout.max_new_tokens", "2", "--trust_remote_code", "--out", str(tmp_path / "o.jsonl"))
    assert marker.exists() and got["eval/d/prompts"] == 1


def test_remote_code_keys_cover_every_model_of_the_config():
    from megaforge.config import load_config

    base = ["--model.config", "configs/models/tiny-qwen2", "--data.path", "arithmetic"]
    assert TOOL.remote_code_keys(load_config(base)) == []
    cfg = load_config(base + ["--model.trust_remote_code", "true", "--rewards.functions",
                              "[{name: math}, {name: reward_model, reward_model: {path: x, trust_remote_code: true}}]"])
    assert TOOL.remote_code_keys(cfg) == ["model.trust_remote_code",
                                          "rewards.functions[1].reward_model.trust_remote_code"]
    with pytest.raises(TOOL.EvaluateError, match=r"^--model m: c.yaml sets model.trust_remote_code, "
                                                 r"rewards.functions\[1\].reward_model.trust_remote_code true"):
        TOOL.refuse_remote_code(cfg, "m", "c.yaml", allowed=False)
    TOOL.refuse_remote_code(cfg, "m", "c.yaml", allowed=True)


def test_several_models_through_one_engine_start_equal_each_alone(tmp_path, evaluate, capsys):
    """Two tiny Qwen2 folders of different weights: evaluated together (the second reaches the running engine
    through its weight update) each gives the responses and metrics it gives alone (float32 engine on the
    CPU: the same weights and prompts decode the same greedy tokens, compared exactly). The second is the
    first with its final norm zeroed: every logit exactly 0, so greedy picks token 0 on every CPU kind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import make_tiny_model

    a = make_tiny_model(str(tmp_path / "a"), seed=1)
    b = str(tmp_path / "b")
    m = AutoModelForCausalLM.from_pretrained(a)
    with torch.no_grad():
        m.model.norm.weight.zero_()
    m.save_pretrained(b)
    AutoTokenizer.from_pretrained(a).save_pretrained(b)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {x} + 2?", "a": str(x + 2)}) + "\n" for x in range(4)))
    common = ["--data", str(data), "--input_key", "q", "--label_key", "a", "--k", "2", "--rollout.max_new_tokens", "8",
              "--data.apply_chat_template", "false", "--data.max_prompt_len", "64"]
    rc = TOOL.main(["--model", a, "--model", b, "--out", str(tmp_path / "both_{model}.jsonl"), *common])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    both = [json.loads(line) for line in out.strip().splitlines()[-2:]]
    assert [r["weight_version"] for r in both] == [0, 1] and [r["model"] for r in both] == [a, b]
    for i, m in enumerate((a, b)):
        alone, _ = evaluate("--model", m, "--out", str(tmp_path / f"alone_{i}.jsonl"), *common)
        greedy = [r["response"] for r in samples(str(tmp_path / f"both_{i}.jsonl")) if r["mode"] == "greedy"]
        assert greedy == [r["response"] for r in samples(str(tmp_path / f"alone_{i}.jsonl")) if r["mode"] == "greedy"]
        assert both[i]["eval/sums/greedy/pass@1"] == alone["eval/sums/greedy/pass@1"]
    # the two models answer differently: the second evaluation did not reuse the first's weights
    ga = [r["response"] for r in samples(str(tmp_path / "both_0.jsonl")) if r["mode"] == "greedy"]
    gb = [r["response"] for r in samples(str(tmp_path / "both_1.jsonl")) if r["mode"] == "greedy"]
    assert ga != gb


def test_several_models_need_one_architecture_and_an_out_template(tmp_path, evaluate):
    from tests.conftest import make_tiny_model

    a = make_tiny_model(str(tmp_path / "a"), seed=1)
    wide = make_tiny_model(str(tmp_path / "wide"), seed=1, intermediate_size=96)
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    common = ["--data", str(data), "--rollout.max_new_tokens", "4", "--data.apply_chat_template", "false",
              "--data.max_prompt_len", "64", "--k", "0"]
    _, err = evaluate("--model", a, "--model", wide, "--out", str(tmp_path / "x.jsonl"), *common, expect_rc=1)
    assert "with several --model it must hold {model}" in err
    _, err = evaluate("--model", a, "--model", wide, "--out", str(tmp_path / "x_{model}.jsonl"), *common, expect_rc=1)
    assert f"--model {wide}: config.json intermediate_size" in err and f"first --model {a}" in err
    assert os.path.exists(tmp_path / "x_0.jsonl")  # the first model's results were written before the refusal
