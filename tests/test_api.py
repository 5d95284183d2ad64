"""The Python API (megaforge.api, exported from megaforge; issue 41, point 7): both examples of
examples/api/ run on the tiny CPU model, the pieces (tokenizer, trainer, engine, rewards; generate,
score, train_step, push_weights) work on their own, load_config takes a path, a dict or a Config with
dict or command-line overrides, and GenerateRequest.input_ids refuses what is not a list of ints."""
import importlib.util
import json
import os

import pytest
import torch

import megaforge
from megaforge.configtree import ConfigError
from megaforge.types import GenerateRequest, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = {"sft.max_steps": 2, "sft.batch_size": 8, "rollout.batch_size": 2, "grpo.n_samples": 4,
        "rollout.max_new_tokens": 6, "metrics.progress": False, "metrics.tensorboard": False,
        "metrics.log_samples": 0, "rollout.device": "cpu"}


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"api_example_{name}", os.path.join(ROOT, "examples", "api", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_run_from_a_dict_example(tmp_path, capsys):
    rewards = example("run_from_dict").main(str(tmp_path), max_steps=2, **TINY)
    assert len(rewards) == 2
    run = tmp_path / "api_dict"
    with open(run / "config.yaml") as f:
        saved = f.read()
    assert "arithmetic" in saved and os.path.isdir(run / "checkpoints" / "step_000002")
    assert f"{run}: reward/mean" in capsys.readouterr().out


def test_the_manual_loop_example(tmp_path, capsys):
    history = example("manual_loop").main(str(tmp_path), steps=2, **TINY)
    assert len(history) == 2 and all("loss" in m and "reward/mean" in m for m in history)
    out = capsys.readouterr().out
    assert "step 2: reward" in out and out.count(": reward ") >= 3  # two steps and the own prompt's answers


def first_bucket(trainer) -> dict:
    return {n: t.clone() for n, t in next(iter(trainer.iter_hf_buckets(1 << 30)))}


def test_the_pieces_on_their_own(tmp_path):
    cfg = megaforge.load_config(DEMO, {**TINY, "output_dir": str(tmp_path), "grpo.beta": 0.0})
    tok = megaforge.load_tokenizer(cfg)
    trainer = megaforge.build_trainer(cfg, tok)
    engine = megaforge.build_engine(cfg, tok)
    rewards = megaforge.build_rewards(cfg)
    try:
        megaforge.push_weights(trainer, engine, cfg)
        assert engine.weight_version == trainer.version
        samples = megaforge.generate(engine, tok, ["What is 1 + 1?", "What is 2 + 2?"], cfg, labels=["2", "4"])
        assert [s.group_id for s in samples] == [0] * 4 + [1] * 4 and samples[4].label == "4"
        m = megaforge.score(samples, rewards, cfg)
        assert "reward/math" in m and m["reward/mean"] == sum(s.reward for s in samples) / 8
        for i, s in enumerate(samples):  # your own rewards: any number per sample
            s.reward = float(i % 2)
        before = first_bucket(trainer)
        m = megaforge.train_step(trainer, samples, cfg, engine)
        assert m["advantages/nonzero_frac"] > 0 and m["grad_norm"] > 0
        after = first_bucket(trainer)
        assert any(not torch.equal(before[n], after[n]) for n in before)
        megaforge.push_weights(trainer, engine, cfg)
        assert engine.weight_version == trainer.version
    finally:
        engine.shutdown()
        rewards.close()


def test_load_config_sources_and_overrides(tmp_path):
    a = megaforge.load_config(DEMO, ["--grpo.n_samples", "4", "--output_dir", str(tmp_path)])
    b = megaforge.load_config(DEMO, {"grpo.n_samples": 4, "output_dir": str(tmp_path)})
    assert a == b and a.grpo.n_samples == 4 and a.model.tokenizer == "assets/tiny-tokenizer"
    c = megaforge.load_config(a, {"trainer.lr": 1e-4})
    assert c.trainer.lr == 1e-4 and c.grpo.n_samples == 4 and a.trainer.lr == 3e-4
    assert megaforge.load_config({"grpo": {"n_samples": 2}, "data": {"path": "x.jsonl"}, "model": {"path": "m"}}).grpo.n_samples == 2
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.n_sample'; did you mean 'grpo.n_samples'"):
        megaforge.load_config(DEMO, {"grpo.n_sample": 4})
    with pytest.raises(ConfigError, match=r"grpo.n_samples"):
        megaforge.load_config(DEMO, {"grpo.n_samples": "four"})
    with pytest.raises(TypeError, match=r"source must be a YAML file's path, a dict or a Config, not int"):
        megaforge.load_config(3)


def test_generate_request_input_ids_are_checked(tokenizer):
    sp = SamplingParams()
    with pytest.raises(TypeError, match=r"GenerateRequest.input_ids must be a list of token ids \(int\), not a "
                                        r"BatchEncoding: .*\['input_ids'\]"):
        GenerateRequest(tokenizer("What is 1 + 1?"), sp)
    with pytest.raises(TypeError, match=r"GenerateRequest.input_ids\[1\] is a str .* pass a list of token ids"):
        GenerateRequest([1, "2"], sp)
    with pytest.raises(TypeError, match=r"input_ids\[0\] is a list .* one GenerateRequest per prompt"):
        GenerateRequest([[1, 2]], sp)
    with pytest.raises(TypeError, match=r"input_ids\[0\] is a Tensor .*\.tolist\(\)"):
        GenerateRequest(list(torch.tensor([1, 2])), sp)
    assert GenerateRequest((1, 2), sp).input_ids == [1, 2]


def test_the_exports_are_the_api_and_lazy():
    from megaforge import api

    for name in ("load_config", "run_grpo", "run_sft", "Session", "build_trainer", "build_engine", "build_rewards",
                 "generate", "score", "train_step", "push_weights"):
        assert getattr(megaforge, name) is getattr(api, name), name
    with pytest.raises(AttributeError):
        megaforge.no_such_thing  # noqa: B018
    assert json.loads(json.dumps(sorted(megaforge.__all__)))  # names only
