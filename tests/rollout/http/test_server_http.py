"""The HTTP engine end to end: megaforge's SGLang client and HTTPEngine against the embedded server,
launched by build_engine (rollout.engine: embedded_server) on 127.0.0.1, over real HTTP."""
from __future__ import annotations

import base64
import os
import pickle
import re
import struct
import threading
import time

import pytest
import torch

from engine_helpers import (BUILD_ON_CLASS, BYTEARRAY8, BYTEARRAY_CALL, buckets_of, engine_config, hf_output_logprobs,
                            http, perturbed_state)
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 17, 33, 9], [100, 101], [7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def engine(long_model_dir, tmp_path_factory, tokenizer):
    from megaforge.rollout import build_engine

    eng = build_engine(RunBuilder(engine_config(tmp_path_factory.mktemp("run"), long_model_dir)).engine_spec(), tokenizer)
    yield eng
    eng.shutdown()
    assert not any(p.alive() for p in eng.processes)


@pytest.fixture(scope="module")
def url(engine):
    return engine.clients[0].url


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _sample(engine, max_new=12, seed=11):
    from megaforge.types import GenerateRequest, SamplingParams

    sp = lambda i: SamplingParams(temperature=1.0, max_new_tokens=max_new, stop_token_ids=[], seed=seed + i)
    return engine.generate([GenerateRequest(p, sp(i), rid=f"r{i}") for i, p in enumerate(PROMPTS)])


def _check_served_logprobs(engine, ref_model, version: int):
    comps = _sample(engine)
    worst = 0.0
    for p, c in zip(PROMPTS, comps):
        assert c.weight_version == version and len(c.output_ids) == 12 and c.finish_reason == "length"
        ref = hf_output_logprobs(ref_model, p, c.output_ids)
        worst = max(worst, (ref - torch.tensor(c.output_logprobs)).abs().max().item())
    # float32 logprobs (|lp| <= ~8) of the served engine (batched, KV cache) vs one HF forward per row:
    # other sum orders, ~1-2 ulp (<= 9.5e-7); a stale or wrong weight moves them by >= 1e-2
    assert worst <= 1e-5, f"served logprobs differ from the HF model's by {worst:.2e}"
    return comps


def test_log_file_and_launch(engine, tmp_path_factory):
    proc = engine.processes[0]
    assert proc.alive() and proc.log_path.endswith(os.path.join("logs", "engine_0.log"))
    assert "megaforge.rollout.server" in open(proc.log_path).read()


def test_generate_fields_single_and_batch(engine, url):
    st, out = http(url, "POST", "/generate", {"input_ids": PROMPTS[0], "rid": "one", "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 5, "temperature": 0.0}})
    assert st == 200, out
    m = out["meta_info"]
    assert m["id"] == "one" and m["prompt_tokens"] == 4 and m["completion_tokens"] == len(out["output_ids"]) == 5
    assert m["finish_reason"] == {"type": "length", "length": 5} and m["weight_version"] == "0"
    assert [lp[1] for lp in m["output_token_logprobs"]] == out["output_ids"]
    assert all(lp[0] <= 0 and lp[2] is None for lp in m["output_token_logprobs"]) and isinstance(out["text"], str)
    # batch: rid prefix, per-item sampling params, stop token kept in output_ids (no_stop_trim)
    st, outs = http(url, "POST", "/generate", {"input_ids": PROMPTS[:2], "rid": "b", "return_logprob": [True, False],
                                              "sampling_params": [{"max_new_tokens": 3, "temperature": 0.0},
                                                                  {"max_new_tokens": 4, "temperature": 0.0}]})
    assert st == 200 and [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1"]
    assert len(outs[0]["output_ids"]) == 3 and len(outs[1]["output_ids"]) == 4
    assert "output_token_logprobs" in outs[0]["meta_info"] and "output_token_logprobs" not in outs[1]["meta_info"]
    greedy = outs[0]["output_ids"]
    st, stopped = http(url, "POST", "/generate", {"input_ids": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0.0, "stop_token_ids": [greedy[0]], "ignore_eos": False}})
    assert stopped["output_ids"] == greedy[:1] and stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": greedy[0]}


def test_update_from_tensor_matches_hf_and_advances_version(engine, long_model_dir):
    ref, named = perturbed_state(long_model_dir, seed=1)
    engine.update_weights(buckets_of(named, 3), version=7)
    assert engine.weight_version == 7
    _check_served_logprobs(engine, ref, 7)


def test_update_from_disk_matches_hf(engine, url, long_model_dir, tmp_path):
    from megaforge.rollout.http.engine import HTTPEngine

    ref, named = perturbed_state(long_model_dir, seed=2)
    ref.save_pretrained(tmp_path / "w")
    st, out = http(url, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "w"), "weight_version": "8"})
    assert st == 200 and out["success"], out
    assert engine.weight_version == 8
    _check_served_logprobs(engine, ref, 8)
    # the disk transport of HTTPEngine: buckets written as safetensors shards, then the same endpoint
    ref, named = perturbed_state(long_model_dir, seed=3)
    disk = HTTPEngine([url], transport="disk", model_dir=long_model_dir)
    try:
        disk.update_weights(buckets_of(named, 2), version=9)
    finally:
        disk.shutdown()
    _check_served_logprobs(engine, ref, 9)


def test_update_from_distributed_gloo_matches_hf(engine, url, long_model_dir):
    from megaforge.rollout.http.engine import HTTPEngine

    ref, named = perturbed_state(long_model_dir, seed=4)
    dist_engine = HTTPEngine([url], transport="nccl")  # CPU tensors: a gloo group, this process is rank 0
    try:
        dist_engine.update_weights(buckets_of(named, 3), version=10)
        assert dist_engine.weight_transport.group is not None
        st, info = http(url, "GET", "/server_info")
        assert info["weight_update_groups"] == ["megaforge_weight_update"]
    finally:
        dist_engine.shutdown()
    assert http(url, "GET", "/server_info")[1]["weight_update_groups"] == []
    assert engine.weight_version == 10
    _check_served_logprobs(engine, ref, 10)


def test_fast_path_server_follows_every_update_route(long_model_dir, tmp_path, tokenizer):
    """The embedded server on the fast path (rollout.fast on: static cache, fused q/k/v and gate/up
    weights viewed by the parameters, fast/fuse.py) after updates through /update_weights_from_tensor,
    /update_weights_from_disk and /update_weights_from_distributed (gloo): it serves the new weights."""
    from megaforge.rollout import build_engine
    from megaforge.rollout.http.engine import HTTPEngine

    eng = build_engine(RunBuilder(engine_config(tmp_path / "run", long_model_dir, fast="on", fast_compile="off")).engine_spec(), tokenizer)
    try:
        with open(eng.processes[0].log_path) as f:
            assert "--fast on" in f.read()
        url = eng.clients[0].url
        ref, named = perturbed_state(long_model_dir, seed=31)
        eng.update_weights(buckets_of(named, 3), version=31)
        _check_served_logprobs(eng, ref, 31)
        ref, _ = perturbed_state(long_model_dir, seed=32)
        ref.save_pretrained(tmp_path / "w")
        st, out = http(url, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "w"), "weight_version": "32"})
        assert st == 200 and out["success"], out
        _check_served_logprobs(eng, ref, 32)
        ref, named = perturbed_state(long_model_dir, seed=33)
        dist = HTTPEngine([url], transport="nccl")  # CPU tensors: a gloo group, this process is rank 0
        try:
            dist.update_weights(buckets_of(named, 3), version=33)
        finally:
            dist.shutdown()
        _check_served_logprobs(eng, ref, 33)
    finally:
        eng.shutdown()


def test_wrong_fields_are_400_naming_them(url):
    cases = [
        ("/generate", {"input_ids": [1, 2], "max_tokens": 3}, "max_tokens"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": [{"max_new_tokens": 2}, {"topp": 1}]}, "sampling_params"),
        ("/generate", {"input_ids": "1 2"}, "input_ids"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "flush": True}, "flush"),
        ("/update_weights_from_disk", {"weight_version": "3"}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 3}, "weight_version"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1,
                                        "world_size": 2}, "master_port"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags[0]"),
        ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ]
    for path, body, field in cases:
        st, out = http(url, "POST", path, body)
        assert st == 400, (path, body, out)
        assert out["param"].startswith(field) and f"`{out['param']}`" in out["message"], (path, out)
    st, out = http(url, "POST", "/generate", b"{not json")
    assert st == 400 and out["param"] == "<body>"


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_unknown_pickled_global_refused(url, tmp_path):
    marker = tmp_path / "pwned"
    assert http(url, "POST", "/begin_weight_update", {})[0] == 200
    try:
        for obj, name in ((_Evil(marker), "posix.system"), ([("w", eval)], "builtins.eval")):
            payload = base64.b64encode(pickle.dumps(obj)).decode()
            st, out = http(url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
            assert st == 400 and out["param"] == "serialized_named_tensors" and name in out["message"], out
        assert not marker.exists()
    finally:
        assert http(url, "POST", "/end_weight_update", {})[0] == 200
    # outside a begin/end session a tensor update is refused, as in sglang 0.5.23
    st, out = http(url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]})
    assert st == 400 and out["success"] is False and "begin_weight_update" in out["message"]


def _checksums(url):
    st, out = http(url, "POST", "/get_weights_checksum", {})
    assert st == 200, out
    return {n: v["sha256"] for n, v in out["tensors"].items()}


def test_malicious_tensor_payloads_are_400_and_later_updates_work(engine, url, long_model_dir):
    """Issue 21, item 5: each payload is refused with 400 naming serialized_named_tensors, nothing
    changes, and the shared-memory transport keeps working afterwards."""
    from megaforge.sync import wire

    before, version = _checksums(url), http(url, "GET", "/get_weight_version")[1]
    flat, metas = wire.flatten([("lm_head.weight", torch.zeros(512, 64))])
    lying = wire.deserialize(wire.flattened_bucket_payload(flat, metas))
    lying["metadata"][0].end_idx = 1 << 40  # metadata pointing far outside the 128 KiB buffer
    bad_shape = wire.flattened_bucket_payload(*wire.flatten([("model.norm.weight", torch.ones(64)),
                                                             ("lm_head.weight", torch.ones(3, 3))]))
    assert http(url, "POST", "/begin_weight_update", {})[0] == 200
    try:
        for raw in (BUILD_ON_CLASS, BYTEARRAY_CALL, BYTEARRAY8, pickle.dumps(lying)):
            st, out = http(url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [
                base64.b64encode(raw).decode()], "load_format": "flattened_bucket"})
            assert st == 400 and out["param"] == "serialized_named_tensors", out
        # a well-formed bucket whose second tensor does not fit: refused before the first copy
        st, out = http(url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [bad_shape],
                                                                   "load_format": "flattened_bucket"})
        assert st == 400 and out["success"] is False and "no weights were changed" in out["message"], out
        assert "lm_head.weight" in out["message"]
    finally:
        assert http(url, "POST", "/end_weight_update", {})[0] == 200
    assert _checksums(url) == before and http(url, "GET", "/get_weight_version")[1] == version
    ref, named = perturbed_state(long_model_dir, seed=12)
    engine.update_weights(buckets_of(named, 3), version=12)  # the shm transport, after the attacks
    _check_served_logprobs(engine, ref, 12)


def _write_shards(d, named, k=2):
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    for i, part in enumerate(buckets_of(named, k)):
        save_file({n: t.contiguous() for n, t in part}, os.path.join(d, f"model-{i:05d}.safetensors"))
    return sorted(os.path.join(d, f) for f in os.listdir(d))


def test_update_from_disk_is_all_or_nothing(engine, url, long_model_dir, tmp_path):
    """Issue 21, item 5: a bad file anywhere in the folder -> 400 naming it; weights and version stay."""
    from safetensors.torch import save_file

    before, version = _checksums(url), http(url, "GET", "/get_weight_version")[1]
    _, named = perturbed_state(long_model_dir, seed=13)

    def corrupt_truncated(files):
        data = open(files[-1], "rb").read()
        open(files[-1], "wb").write(data[: len(data) // 2])

    def corrupt_header(files):
        open(files[-1], "wb").write(struct.pack("<Q", 12) + b"{not json..." + b"\0" * 64)

    def wrong_shape(files):
        save_file({"lm_head.weight": torch.zeros(3, 3)}, files[-1])

    def unknown_name(files):
        save_file({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}, files[-1])

    def duplicate(files):
        save_file({named[0][0]: named[0][1]}, files[-1])

    def int_dtype(files):
        save_file({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}, files[-1])

    for k, (corrupt, words) in enumerate(((corrupt_truncated, "do not hold|does not fit|cannot"),
                                          (corrupt_header, "not valid JSON"), (wrong_shape, "shape"),
                                          (unknown_name, "no tensor"), (duplicate, "also in"), (int_dtype, "dtype"))):
        d = str(tmp_path / f"ckpt{k}")
        files = _write_shards(d, named)
        corrupt(files)
        st, out = http(url, "POST", "/update_weights_from_disk", {"model_path": d, "weight_version": "99"})
        assert st == 400 and out["success"] is False, (corrupt.__name__, out)
        assert re.search(words, out["message"]) and os.path.basename(files[-1]) in out["message"], (corrupt.__name__, out)
        assert _checksums(url) == before, f"{corrupt.__name__}: weights changed"
        assert http(url, "GET", "/get_weight_version")[1] == version
    # a glob is not expanded: the literal path does not exist
    _write_shards(str(tmp_path / "real"), named)
    st, out = http(url, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "re*")})
    assert st == 400 and "not a directory" in out["message"] and _checksums(url) == before


def test_memory_release_resume_state_is_checked(engine, url, long_model_dir):
    from megaforge.rollout.base import EngineStateError

    engine.release_memory(["weights", "kv_cache"])
    st, out = http(url, "POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert st == 400 and "released" in out["error"]["message"]
    st, out = http(url, "POST", "/update_weights_from_disk", {"model_path": long_model_dir})
    assert st == 400 and "released" in out["error"]["message"]
    assert http(url, "GET", "/health_generate")[0] == 503
    with pytest.raises(EngineStateError):
        engine.update_weights([[("lm_head.weight", torch.zeros(1))]], 99)
    st, out = http(url, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert st == 400 and "already released" in out["error"]["message"]
    engine.resume_memory(["weights"])
    engine.resume_memory(["kv_cache", "cuda_graph"])  # cuda_graph was never released: not sent
    st, out = http(url, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
    assert st == 400 and "not released" in out["error"]["message"]
    assert engine.released == set() and engine.health()


def _background_generate(engine, payload):
    box = {}

    def run():
        box["out"] = engine._call(engine.clients[0].generate(payload))

    t = threading.Thread(target=run)
    t.start()
    return t, box


def _wait_running(url, n=1, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if http(url, "GET", "/server_info")[1]["running_requests"] >= n:
            return
        time.sleep(0.01)
    raise AssertionError("the request never started")


def test_abort_all_stops_a_running_request(engine, url):
    t, box = _background_generate(engine, {"input_ids": [3, 4, 5], "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
    _wait_running(url)
    engine.abort()
    t.join(60)
    m = box["out"]["meta_info"]
    assert m["finish_reason"]["type"] == "abort" and m["completion_tokens"] < 3000
    assert len(m["output_token_logprobs"]) == m["completion_tokens"]


def test_pause_and_continue_generation(engine, url):
    run = engine._call
    c = engine.clients[0]
    run(c.pause_generation())
    assert http(url, "GET", "/server_info")[1]["paused"] is True
    t, box = _background_generate(engine, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 4}})
    time.sleep(0.5)
    assert "out" not in box  # held while paused
    run(c.continue_generation())
    t.join(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    st, out = http(url, "POST", "/pause_generation", {"mode": "in_place"})
    assert st == 400 and out["param"] == "mode"


def test_flush_health_info_endpoints(engine, url):
    c = engine.clients[0]
    engine._call(c.flush_cache())
    assert http(url, "GET", "/flush_cache")[0] == 200
    assert engine._call(c.health()) and engine._call(c.health_generate()) and engine.health()
    v = engine.weight_version
    assert http(url, "GET", "/get_weight_version")[0] == 404  # as sglang >= 0.5.21: /model_info has it
    engine._call(c.update_weight_version(str(v + 100)))  # a version without a weight change
    assert engine.weight_version == v + 100 and engine._call(c.get_weight_version()) == v + 100
    engine._call(c.update_weight_version(str(v)))
    for path in ("/get_model_info", "/model_info"):
        info = http(url, "GET", path)[1]
        assert info["weight_version"] == str(v) and info["model_type"] == "qwen2" and info["is_generation"]
    info = http(url, "GET", "/get_server_info")[1]
    assert info["host"] == "127.0.0.1" and info["released_memory"] == [] and info["tp_size"] == 1
    st, out = http(url, "POST", "/abort_request", {"rid": "nobody", "abort_all": False})
    assert st == 200


def test_client_error_names_endpoint_status_and_body(engine):
    from megaforge.rollout.http.client import EngineHTTPError, EngineUnreachable, SGLangClient

    with pytest.raises(EngineHTTPError) as e:
        engine._call(engine.clients[0].update_weights_from_disk("/nonexistent/dir"))
    assert e.value.status == 400 and e.value.endpoint == "/update_weights_from_disk"
    assert "/update_weights_from_disk answered HTTP 400" in str(e.value) and "/nonexistent/dir" in str(e.value)
    from megaforge.net import free_port

    dead = SGLangClient(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05)
    t0 = time.time()
    with pytest.raises(EngineUnreachable, match="3 attempt"):
        engine._call(dead.request("GET", "/health"))
    assert time.time() - t0 >= 0.15  # backoff 0.05 + 0.1
    engine._call(dead.close())


def test_flush_cache_retries_while_requests_drain(engine, url):
    t, box = _background_generate(engine, {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3000,
                                                                                     "ignore_eos": True}})
    _wait_running(url)
    st, _ = http(url, "POST", "/flush_cache")
    assert st == 400  # refused while a request runs, as SGLang
    timer = threading.Timer(0.5, engine.abort)
    timer.start()
    t0 = time.time()
    engine.flush_cache()  # the client retries until the request has drained
    assert time.time() - t0 >= 0.4
    t.join(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_transport_choices_are_checked(url):
    from megaforge.rollout.http.engine import HTTPEngine

    with pytest.raises(ValueError, match="inproc"):
        HTTPEngine([url], transport="inproc")
    ipc = HTTPEngine([url], transport="ipc")
    try:
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            ipc.update_weights([[("lm_head.weight", torch.zeros(512, 64))]], 1)
        assert http(url, "GET", "/server_info")[1]["weight_update_session"] is False  # the session was closed
    finally:
        ipc.shutdown()


def test_restart_after_kill_then_resync(engine, long_model_dir):
    """Last in the module: the building block of engine fault tolerance (issue 10)."""
    import signal

    old_pid = engine.processes[0].pid
    os.kill(old_pid, signal.SIGKILL)
    engine.processes[0].proc.wait(10)
    assert not engine.health()
    engine.restart_server(0, timeout_s=180)
    assert engine.processes[0].pid != old_pid and engine.health() and engine.weight_version == 0
    ref, named = perturbed_state(long_model_dir, seed=5)
    engine.update_weights(buckets_of(named, 2), version=11)
    _check_served_logprobs(engine, ref, 11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_engine_server_takes_ipc_updates_after_malicious_payloads(long_model_dir, tmp_path, tokenizer):
    from engine_helpers import buckets_of, engine_config, hf_output_logprobs, http, perturbed_state
    from megaforge.rollout import build_engine
    from megaforge.types import GenerateRequest, SamplingParams

    eng = build_engine(RunBuilder(engine_config(tmp_path, long_model_dir, device="cuda")).engine_spec(), tokenizer)
    try:
        url = eng.clients[0].url
        assert http(url, "POST", "/begin_weight_update", {})[0] == 200
        for raw in (BUILD_ON_CLASS, BYTEARRAY_CALL, BYTEARRAY8):
            st, out = http(url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [b64(raw)]})
            assert st == 400 and out["param"] == "serialized_named_tensors", out
        assert http(url, "POST", "/end_weight_update", {})[0] == 200
        ref, named = perturbed_state(long_model_dir, seed=21)
        eng.update_weights(buckets_of([(n, t.cuda()) for n, t in named], 3), version=21)  # CUDA IPC buckets
        prompt = [5, 17, 33, 9]
        c = eng.generate([GenerateRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=[],
                                                                 seed=3), rid="r")])[0]
        assert c.weight_version == 21
        diff = (hf_output_logprobs(ref, prompt, c.output_ids) - torch.tensor(c.output_logprobs)).abs().max().item()
        assert diff < 1e-3, diff  # float32 on the GPU against the CPU model: TF32-free, 2 layers, 8 tokens
    finally:
        eng.shutdown()
