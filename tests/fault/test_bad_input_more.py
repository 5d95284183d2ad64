"""Bad input (issue 10, point 4), continued: a prompt + response longer than the model's context and
an engine GPU that does not exist fail at start-up naming the config keys, before any run directory
is written; empty responses (an engine's aborted requests) batch and train without touching the loss.
The runs run in the test's process (run_helpers.run_in_process)."""
import os

import pytest
import torch
from run_helpers import completed_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
TINY = ["--config", DEMO, "--sft.max_steps", "2", "--rollout.batch_size", "2", "--grpo.n_samples", "2",
        "--rollout.max_new_tokens", "8", "--max_steps", "1", "--metrics.progress", "false"]


def launch(out, *extra):
    return completed_in_process("grpo", [*TINY, "--output_dir", out, "--run_name", "r", *extra])


def test_prompt_plus_response_longer_than_context_fails_at_startup(tmp_path):
    # configs/models/tiny-qwen2: max_position_embeddings 512
    p = launch(str(tmp_path), "--data.max_prompt_len", "500", "--rollout.max_new_tokens", "24")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert ("config keys 'data.max_prompt_len' (500) + 'rollout.max_new_tokens' (24) = 524 tokens exceed the model's "
            "context of 512") in p.stderr
    assert not os.path.exists(tmp_path / "r")  # before SFT, nothing written


def test_context_limit_follows_rope_scaling():
    from transformers import Qwen2Config

    from megaforge.rollout import context_limit

    assert context_limit(Qwen2Config(max_position_embeddings=4096)) == 4096
    yarn = Qwen2Config(max_position_embeddings=32768,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert context_limit(yarn) == 131072


def test_engine_gpu_that_does_not_exist_fails_at_startup(tmp_path):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for engine in ("embedded", "embedded_server"):
        p = launch(str(tmp_path), "--rollout.engine", engine, "--rollout.device", f"cuda:{have + 3}")
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert f"config key 'rollout.device': device 'cuda:{have + 3}' requested but this machine has" in p.stderr
        assert not os.path.exists(tmp_path / "r")


def _samples(empty):
    from megaforge.types import Sample

    out = []
    for i, e in enumerate(empty):
        resp = [] if e else [5 + i, 6, 7, 8][: 2 + i % 3]
        out.append(Sample(prompt_ids=[1, 2, 3 + i], response_ids=resp, rollout_logprobs=[-1.0] * len(resp),
                          group_id=i // 2, finish_reason="abort" if e else "length", weight_version=0,
                          reward=float(i % 3)))
    return out


def _trainer(model_dir, tokenizer, **algo):
    from megaforge.config import config_from_dict
    from megaforge.build import RunBuilder

    cfg = config_from_dict({"model": {"path": model_dir}, "trainer": {"device": "cpu", "micro_batch_size": 2},
                            "algo": algo, "max_steps": 0, "seed": 0})
    torch.manual_seed(0)
    tr = RunBuilder(cfg).trainer(tokenizer)
    tr.reset_optimizer(1e-3, 10, 0, "constant")
    return tr


def test_empty_responses_are_batched_and_not_trained(tiny_model_dir, tokenizer):
    """Aborted requests come back with 0 tokens: they batch (no loss tokens), and a step with them
    equals the same step without them (same per-token advantages); the HTTP answer parses too."""
    from megaforge.data.batch import samples_to_batch, set_denominators
    from megaforge.rollout.http.protocol import completion_from_output

    c = completion_from_output({"text": "", "output_ids": [], "meta_info": {
        "id": "s1-g0-n1", "finish_reason": {"type": "abort", "message": "Aborted"}, "weight_version": "3",
        "output_token_logprobs": []}})
    assert c.output_ids == [] and c.finish_reason == "abort" and c.weight_version == 3
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        empty = [False, True, False, True, True, False]
        full = samples_to_batch(_samples(empty), 0)
        assert full.loss_mask[[1, 3, 4]].sum() == 0 and full.num_seqs == 3
        kept = samples_to_batch([s for s, e in zip(_samples(empty), empty) if not e], 0)
        adv = torch.arange(full.tokens.numel(), dtype=torch.float32).reshape(full.tokens.shape) % 3 - 1.0
        full.advantages = adv * full.loss_mask
        kept.advantages = full.advantages[[0, 2, 5], : kept.tokens.shape[1]]
        set_denominators(full), set_denominators(kept)
        m_full = _trainer(tiny_model_dir, tokenizer, loss_agg=agg).train_step(full)
        m_kept = _trainer(tiny_model_dir, tokenizer, loss_agg=agg).train_step(kept)
        assert m_full["skipped"] == 0 and torch.isfinite(torch.tensor(m_full["loss"]))
        # float32, the same tokens in other micro-batches and padding: sums over ~30 tokens and the
        # 2-layer model's 64-128-term dot products in other orders, ~1e-6 relative; the grad norm sums
        # squares of ~1e5 parameters whose rounding is ~1e-6 relative each. An empty row that counted
        # (in a denominator or the loss) changes both by >= 1e-1
        assert m_full["loss"] == pytest.approx(m_kept["loss"], rel=1e-5, abs=1e-7), agg
        assert m_full["grad_norm"] == pytest.approx(m_kept["grad_norm"], rel=1e-4), agg


def test_all_empty_responses_skip_the_step(tiny_model_dir, tokenizer):
    from megaforge.data.batch import samples_to_batch

    b = samples_to_batch(_samples([True] * 4), 0)
    tr = _trainer(tiny_model_dir, tokenizer)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    m = tr.train_step(b)
    # no optimizer step at all (Adam momentum would move the weights even on a zero gradient)
    assert m["empty_minibatches"] == 1.0 and m["skipped"] == 0.0 and tr.version == 0
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())


def test_relative_model_paths_from_another_directory_name_the_field(tmp_path, monkeypatch):
    """A config's relative tokenizer / model path, run from another directory: the error names the
    field, the path and the directory it was read from (not transformers' bare hub OSError)."""
    from types import SimpleNamespace

    from megaforge.hf import ModelSourceError, hf_config, load_tokenizer

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read the variable when it was imported: without this the lookup of
    # 'assets/tiny-tokenizer' as a hub repo goes to the network (70 s of retries on CI's machine)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    cfg = SimpleNamespace(tokenizer="assets/tiny-tokenizer", path=None, trust_remote_code=False)
    with pytest.raises(ModelSourceError) as e:
        load_tokenizer(cfg)
    msg = str(e.value)
    assert "'model.tokenizer': 'assets/tiny-tokenizer'" in msg and str(tmp_path) in msg, msg
    cfg = SimpleNamespace(tokenizer=None, path="models/nowhere", trust_remote_code=False)
    with pytest.raises(ModelSourceError, match=r"'model.path': 'models/nowhere'.*current directory"):
        hf_config(cfg)
    # the same tokenizer by absolute path loads
    cfg = SimpleNamespace(tokenizer=os.path.join(repo, "assets", "tiny-tokenizer"), path=None, trust_remote_code=False)
    assert load_tokenizer(cfg).pad_token_id is not None
