"""sync.lora_adapters with rollout.engine sglang (megaforge.rollout.http.lora) against an HTTP double
that takes sglang 0.5.16's request fields field by field (tests/sglang_double.py says where each comes
from): the server flags from model.lora, each sync's PEFT folder loaded under a versioned name, every
/generate naming the current adapter, the previous one unloaded only once no request uses it, errors
naming the adapter folder and the HTTP status. The real server: tests/gpu/test_sglang_lora.py."""
import os
import threading

import pytest
import torch
from sglang_double import SGLangDouble

from megaforge.config import config_from_dict
from megaforge.configtree import ConfigError
from megaforge.build import RunBuilder


def cfg_for(model_dir, tmp_path, engine="sglang", **sync):
    return config_from_dict({
        "output_dir": str(tmp_path), "run_name": "t", "max_steps": 2, "seed": 0,
        "model": {"path": model_dir, "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj",
                                                                                           "model.layers.0.mlp.up_proj"]}},
        "data": {"path": "arithmetic", "format": "synthetic"},
        "rollout": {"engine": engine}, "sync": {"lora_adapters": True, **sync},
        "trainer": {"backend": "torch", "lr": 1e-2, "micro_batch_size": 4},
    })


@pytest.fixture
def double():
    d = SGLangDouble(eos_id=2).start()
    yield d
    d.stop()


def test_config_accepts_sglang_and_refuses_merged_only_engines(tiny_model_dir, tmp_path):
    cfg_for(tiny_model_dir, tmp_path)  # accepted
    with pytest.raises(ConfigError, match=r"'sync.lora_adapters'.*embedded_server.*embedded, sglang"):
        cfg_for(tiny_model_dir, tmp_path, engine="embedded_server")


def test_server_command_enables_lora_from_model_lora(tiny_model_dir, tmp_path):
    from megaforge.rollout.http.sglang import command
    from megaforge.rollout.http.start import ServerStart

    cfg = cfg_for(tiny_model_dir, tmp_path)
    start = ServerStart(tiny_model_dir, "", "", [], torch.device("cuda"))
    c = command(RunBuilder(cfg).engine_spec(), start, 30000, -1)
    i = c.index("--enable-lora")
    assert c[i:i + 10] == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "up_proj",
                           "v_proj", "--max-loras-per-batch", "3", "--enable-weights-cpu-backup"]  # colocated
    assert "--enable-memory-saver" in c
    cfg.sync.lora_adapters = False  # merged weights: a plain server
    assert "--enable-lora" not in command(RunBuilder(cfg).engine_spec(), start, 1, -1)


def test_targets_sglang_does_not_know_are_a_config_error(tiny_model_dir, tmp_path):
    from megaforge.rollout.http.lora import check_targets

    cfg = cfg_for(tiny_model_dir, tmp_path)
    check_targets(RunBuilder(cfg).engine_spec())
    cfg.model.lora.target_modules = ["q_proj", "model.layers.0.mlp.act_fn"]
    with pytest.raises(ConfigError, match=r"'model.lora.target_modules': SGLang serves .* not \['act_fn'\]"):
        check_targets(RunBuilder(cfg).engine_spec())


def _trainer(cfg, tokenizer):
    from megaforge.trainer.torch_backend import TorchTrainer

    torch.manual_seed(0)
    t = TorchTrainer(RunBuilder(cfg).trainer_spec(), tokenizer)
    with torch.no_grad():  # adapters away from B = 0, so the folder's tensors say something
        for _, p in t.lora.adapter_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return t


def _request(n=2):
    from megaforge.types import GenerateRequest, SamplingParams

    return [GenerateRequest(rid=f"r{i}", input_ids=[5, 6, 7 + i], sampling=SamplingParams(max_new_tokens=4))
            for i in range(n)]


def test_each_sync_loads_a_versioned_adapter_that_requests_name(tiny_model_dir, tokenizer, tmp_path, double):
    from safetensors.torch import load_file

    from megaforge.rollout.http.engine import HTTPEngine
    from megaforge.sync.adapters import push_adapters

    cfg = cfg_for(tiny_model_dir, tmp_path)
    t = _trainer(cfg, tokenizer)
    engine = HTTPEngine([double.url])
    try:
        engine.generate(_request())  # before the first sync: the base, no adapter named
        assert "lora_path" not in double.calls[-1][1]

        stats = push_adapters(t, engine, 1 << 20, 1)
        (ep, body), (ep2, body2) = double.calls[-2:]
        assert ep == "/load_lora_adapter" and body["lora_name"] == "policy-v1"
        assert ep2 == "/update_weight_version" and body2 == {"new_version": "1", "abort_all_requests": False}
        folder = body["lora_path"]
        assert stats["bytes"] == sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) > 0
        saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
        for mod, a, b in t.lora.adapter_tensors():  # the trainer's adapters, under PEFT's names
            key = next(k for k in saved if k.endswith(mod + ".lora_A.weight"))
            assert torch.equal(saved[key], a) and torch.equal(saved[key.replace("lora_A", "lora_B")], b)
        assert stats["tensors"] == len(saved) == 2 * len(list(t.lora.adapter_tensors()))

        out = engine.generate(_request())
        assert double.calls[-1][1]["lora_path"] == ["policy-v1", "policy-v1"]
        assert [c.weight_version for c in out] == [1, 1] and engine.weight_version == 1

        push_adapters(t, engine, 1 << 20, 2)  # nothing in flight: v1 unloaded at once, its folder gone
        assert [c[0] for c in double.calls[-3:]] == ["/load_lora_adapter", "/update_weight_version",
                                                     "/unload_lora_adapter"]
        assert double.calls[-1][1] == {"lora_name": "policy-v1"} and list(double.loaded) == ["policy-v2"]
        assert not os.path.exists(folder)
    finally:
        engine.shutdown()


def test_previous_adapter_is_unloaded_after_its_requests_finish(tiny_model_dir, tokenizer, tmp_path, double):
    from megaforge.rollout.http.engine import HTTPEngine
    from megaforge.sync.adapters import push_adapters

    cfg = cfg_for(tiny_model_dir, tmp_path)
    t = _trainer(cfg, tokenizer)
    engine = HTTPEngine([double.url])
    inside, go = threading.Event(), threading.Event()
    try:
        push_adapters(t, engine, 1 << 20, 1)
        double.inflight_hook = lambda body: (inside.set(), go.wait(10))
        th = threading.Thread(target=engine.generate, args=(_request(),))
        th.start()
        assert inside.wait(10)  # a generate with policy-v1 is in flight
        double.inflight_hook = None
        push_adapters(t, engine, 1 << 20, 2)
        assert set(double.loaded) == {"policy-v1", "policy-v2"}  # v1 kept: its requests are running
        assert engine.adapter_name == "policy-v2"
        go.set()
        th.join(10)
        assert list(double.loaded) == ["policy-v2"]  # unloaded as the last request with it finished
        assert double.calls[-1] == ("/unload_lora_adapter", {"lora_name": "policy-v1"})
    finally:
        go.set()
        engine.shutdown()


def test_a_restarted_server_gets_the_current_adapter_and_no_stale_unload(tiny_model_dir, tokenizer, tmp_path, double):
    from megaforge.rollout.http.engine import HTTPEngine
    from megaforge.sync.adapters import push_adapters

    t = _trainer(cfg_for(tiny_model_dir, tmp_path), tokenizer)
    engine = HTTPEngine([double.url])
    try:
        push_adapters(t, engine, 1 << 20, 1)
        held = engine._acquire_adapter()  # a generate with policy-v1 in flight
        push_adapters(t, engine, 1 << 20, 2)
        double.loaded.clear()  # the server restarts: it comes back with the base alone
        double.weight_version = "0"
        assert engine._reload_adapter(0) and list(double.loaded) == ["policy-v2"] and engine.weight_version == 2
        engine._release_adapter(held)  # policy-v1 is not on the restarted server: nothing to unload there
        assert not any(ep == "/unload_lora_adapter" for ep, _ in double.calls)
    finally:
        engine.shutdown()


def test_sglang_errors_name_the_adapter_folder_and_the_status(tiny_model_dir, tokenizer, tmp_path, double):
    from megaforge.rollout.http.engine import HTTPEngine
    from megaforge.rollout.http.lora import AdapterError

    engine = HTTPEngine([double.url])
    try:
        missing = str(tmp_path / "nowhere")
        with pytest.raises(AdapterError, match=rf"/load_lora_adapter: LoRA adapter 'policy-v3' \(folder {missing}\): "
                                               r"HTTP 400: .*no adapter_config.json"):
            engine.load_adapter(missing, 3)
        assert engine.adapter_name is None  # nothing half-switched: requests still name no adapter
    finally:
        engine.shutdown()


def test_the_double_refuses_fields_sglang_does_not_have(double):
    """The double's field check can fail: a misspelled field is a 422 naming it."""
    import asyncio

    from megaforge.rollout.http.client import EngineHTTPError, SGLangClient

    async def go():
        c = SGLangClient(double.url, retries=0)
        try:
            await c.request("POST", "/load_lora_adapter", {"lora_name": "x", "adapter_path": "/tmp"})
        finally:
            await c.close()

    with pytest.raises(EngineHTTPError, match=r"HTTP 422.*unknown \['adapter_path'\], missing \['lora_path'\]"):
        asyncio.run(go())


def test_two_step_lora_run_loads_one_adapter_per_step(tmp_path, tiny_model_dir):
    """A 2-step LoRA GRPO run through the driver with an engine kind taking adapter folders (HTTPEngine
    over the double, tests/sglang_double_kind.py): every step's push loads the new version's adapter,
    unloads the last one, logs sync/bytes (the folder's size) and time/sync, and step k's requests name
    policy-v(k-1). (The double answers every prompt with the end of sequence: the run's rewards are flat;
    this test is about the sync's wiring.)"""
    import json

    from run_helpers import run_in_process

    import sglang_double_kind

    rc, out, err = run_in_process("grpo", [
        "--config", "configs/demo_cpu.yaml", "--algo.plugins", "[sglang_double_kind]",
        "--rollout.engine", "sglang_double", "--model.path", tiny_model_dir, "--model.config", "",
        "--model.lora.rank", "4", "--sync.lora_adapters", "true", "--output_dir", str(tmp_path), "--run_name", "r",
        "--sft.max_steps", "0", "--max_steps", "2", "--rollout.batch_size", "4", "--grpo.n_samples", "2",
        "--checkpoint.interval", "0", "--metrics.progress", "false", "--metrics.tensorboard", "false"])
    try:
        assert rc == 0, err[-3000:]
        double = sglang_double_kind.DOUBLES[-1]
        lora = [(ep, b.get("lora_name")) for ep, b in double.calls if "lora" in ep]
        # the run's first push (version 0: the fresh adapters, B = 0), then one per step
        assert lora == [("/load_lora_adapter", "policy-v0"), ("/load_lora_adapter", "policy-v1"),
                        ("/unload_lora_adapter", "policy-v0"), ("/load_lora_adapter", "policy-v2"),
                        ("/unload_lora_adapter", "policy-v1")]
        named = [b.get("lora_path") for ep, b in double.calls if ep == "/generate"]
        assert [set(n) for n in named] == [{"policy-v0"}, {"policy-v1"}]
        rows = [json.loads(ln) for ln in open(tmp_path / "r" / "metrics.jsonl")]
        assert [r["weight_version"] for r in rows] == [1.0, 2.0]
        assert all(r["sync/bytes"] > 0 and r["time/sync"] > 0 for r in rows)
    finally:
        for d in sglang_double_kind.DOUBLES:
            d.stop()
        sglang_double_kind.DOUBLES.clear()
