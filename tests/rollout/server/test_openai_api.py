"""The embedded server's OpenAI-compatible routes (issue 41, point 1), through the official ``openai``
client against a real server process on a tiny Qwen2 with a bearer key, and SGLang's ``bench_serving``
in its two OpenAI modes when sglang is installed."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from engine_helpers import ROOT, TOKENIZER, http, save_tiny_qwen2

openai = pytest.importorskip("openai")  # requirements.txt pins it
pytestmark = pytest.mark.timeout(300)
KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from megaforge.rollout.http.processes import ServerProcess
    from megaforge.supervise import child_env

    d = save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny")))
    cmd = lambda port, fd: [sys.executable, "-m", "megaforge.rollout.server", "--model", d, "--port", str(port),  # noqa: E731
                            "--sock-fd", str(fd), "--served-model-name", "tiny"]
    env = child_env(extra={"MEGAFORGE_ENGINE_API_KEY": KEY})
    s = ServerProcess("engine_0", cmd, str(tmp_path_factory.mktemp("log") / "engine.log"), env=env, hold_socket=True,
                      api_key=KEY).start_ready(120)
    s.model_dir = d
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def native(srv, ids, seed, max_new, temperature=1.0):
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "sampling_seed": seed, "temperature": temperature}}
    return http(srv.url, "POST", "/generate", body, token=KEY)[1]


def test_models_list(client, srv):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].owned_by == "megaforge"


def test_completions_with_n_and_logprobs_are_the_engines_samples(client, srv):
    """n = 3 samples of one token-id prompt with seed 7: sample j is the native /generate with seed 7 + j
    (same tokens, same logprobs); usage counts the prompt once."""
    prompt = [5, 6, 7, 8]
    out = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=1.0, seed=7,
                                    logprobs=0, extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == "tiny" and len(out.choices) == 3
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 18
    for j, c in enumerate(sorted(out.choices, key=lambda c: c.index)):
        ref = native(srv, prompt, 7 + j, 6)
        assert c.index == j and c.finish_reason == "length" and c.text == ref["text"]
        lps = ref["meta_info"]["output_token_logprobs"]
        assert c.logprobs.token_logprobs == pytest.approx([lp for lp, _, _ in lps], abs=1e-6)  # same floats, JSON round trip
        assert "".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset[0] == 0
    texts = {c.text for c in out.choices}
    assert len(texts) > 1  # n samples of one seed differ


def test_completions_text_prompts_echo_and_stop(client):
    out = client.completions.create(model="tiny", prompt=["hello", "world"], n=2, max_tokens=3, temperature=0.0,
                                    echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text.startswith("hello") and out.choices[2].text.startswith("world")
    assert out.choices[0].text == out.choices[1].text  # greedy
    full = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0.0).choices[0].text
    stop = full[3:5]
    cut = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0.0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_chat_renders_the_chat_template(client, srv):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2+2?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, n=2, max_completion_tokens=5,
                                         temperature=0.0, logprobs=True)
    tok = AutoTokenizer.from_pretrained(srv.model_dir)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    ref = http(srv.url, "POST", "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.0}}, token=KEY)[1]
    assert out.object == "chat.completion" and out.usage.prompt_tokens == len(ids)
    for c in out.choices:
        assert c.message.role == "assistant" and c.message.content == ref["text"]
        assert [t.logprob for t in c.logprobs.content] == pytest.approx(
            [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-6)


def test_streaming_both_endpoints_matches_the_whole_answer(client):
    kw = dict(model="tiny", max_tokens=6, temperature=1.0, seed=3)
    whole = client.completions.create(prompt="abc", n=2, **kw)
    parts: dict[int, str] = {}
    finish = {}
    for ch in client.completions.create(prompt="abc", n=2, stream=True, **kw):
        for c in ch.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert parts == {c.index: c.text for c in whole.choices} and set(finish.values()) <= {"stop", "length"}
    msgs = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_raw_stream_is_sse_ending_with_done(srv):
    req = urllib.request.Request(srv.url + "/v1/completions", method="POST", data=json.dumps({
        "model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


@pytest.mark.parametrize("call,param", [
    (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "usr", "content": "hi"}]), "messages[0].role"),
    (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0]"),
    (lambda c: c.chat.completions.create(model="tiny", messages=[]), "messages"),
    (lambda c: c.completions.create(model="tiny", prompt="x", logprobs=3), "logprobs"),
    (lambda c: c.completions.create(model="tiny", prompt="x", n=0), "n"),
    (lambda c: c.completions.create(model="tiny", prompt="x", temperature=-1), "temperature"),
    (lambda c: c.completions.create(model="tiny", prompt="x", frequency_penalty=0.5), "frequency_penalty"),
    (lambda c: c.completions.create(model="tiny", prompt=[[5, 99999]]), "prompt"),
    (lambda c: c.completions.create(model="tiny", prompt="x", extra_body={"bogus": 1}), "bogus"),
])
def test_malformed_requests_are_400_naming_the_field(client, call, param):
    with pytest.raises(openai.BadRequestError) as e:
        call(client)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert param.split("[")[0] in err["message"]


def test_too_long_and_non_json_bodies_are_400(srv):
    st, out = http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": [5] * 4000, "max_tokens": 200},
                   token=KEY)
    assert st == 400 and "context length" in out["error"]["message"], out
    st, out = http(srv.url, "POST", "/v1/chat/completions", b"{not json", token=KEY)
    assert st == 400 and out["error"]["param"] == "<body>", out


def test_wrong_or_missing_key_is_401(srv):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong-key-000", max_retries=0).models.list()
    assert e.value.status_code == 401
    assert http(srv.url, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})[0] == 401
    assert http(srv.url, "GET", "/health")[0] == 200  # as the native rule: /health* needs no key


def test_a_generate_fn_with_an_openai_client_through_the_http_engine(srv):
    """examples/openai_client: a rollout.generate_fn given an HTTPEngine reaches /v1 with its URL and key."""
    sys.path.insert(0, ROOT)
    from examples.openai_client.generate_fn import openai_rollout
    from transformers import AutoTokenizer

    from megaforge.rollout.http.engine import HTTPEngine
    from megaforge.types import GenerateRequest, SamplingParams

    engine = HTTPEngine([srv.url], api_key=KEY)
    try:
        assert engine.openai_base_urls == [srv.url + "/v1"]
        tok = AutoTokenizer.from_pretrained(TOKENIZER)
        reqs = [GenerateRequest([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=4), rid=str(k)) for k in range(2)]
        samples = openai_rollout(engine, reqs, [], tok, None, model="tiny")
        ref = native(srv, [5, 6, 7], 0, 4, temperature=0.0)  # greedy: the seed does not matter
        for s in samples:
            assert s.prompt_ids == [5, 6, 7] and s.response_text == tok.decode(ref["output_ids"], skip_special_tokens=True)
            assert len(s.response_ids) == len(s.rollout_logprobs) and s.metadata["episode"]["retokenized"] in (0.0, 1.0)
    finally:
        engine.shutdown()


BENCH_SKIP = ("sglang or datasets is not installed (sglang.bench_serving imports sglang.srt's modules and, at module "
              "level, datasets: the H200 kit has the first, not the second; on a CPU: tools/bench/sglang_bench_env.sh)")


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("sglang", "datasets")), reason=BENCH_SKIP)
@pytest.mark.parametrize("backend", ["sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_serving_openai_modes(srv, backend, tmp_path):
    """SGLang 0.5.16's bench_serving against the embedded server: waits for /v1/models, then 8 random
    prompts, streamed; every request must succeed."""
    out = tmp_path / "bench.jsonl"
    env = {**os.environ, "OPENAI_API_KEY": KEY}
    r = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", srv.url,
                        "--dataset-name", "random-ids", "--tokenizer", TOKENIZER, "--model", "tiny", "--num-prompts", "8",
                        "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1",
                        "--output-file", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text().splitlines()[-1])
    assert res["completed"] == 8, res
