"""SFT data (chat and prompt/response rows, loss on the response only), exact packing, and an SFT
run whose loss goes down."""
import json

import pytest
import torch
from algo_helpers import ROOT, read_metrics, run_launcher

from megaforge.build import RunBuilder
from megaforge.data.batch import sft_batch
from megaforge.data.packing import pack_rows, plan_bins
from megaforge.data.prompts import PromptSource

SFT_CPU = f"{ROOT}/configs/sft_cpu.yaml"
CHAT = [
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is 1 + 2?"},
                  {"role": "assistant", "content": "<think>1+2=3</think> \\boxed{3}"},
                  {"role": "user", "content": "And 2 + 2?"},
                  {"role": "assistant", "content": "\\boxed{4}"}]},
    {"messages": [{"role": "user", "content": "What is 5 - 3?"},
                  {"role": "assistant", "content": "<think>5-3=2</think> \\boxed{2}"}]},
]


def data_cfg(path, **kw):
    from megaforge.config import DataConfig

    return DataConfig(path=str(path), input_key=kw.pop("input_key", "prompt"), shuffle=False, **kw)


def test_chat_rows_train_on_assistant_turns_only(tmp_path, tokenizer):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in CHAT))
    rows = PromptSource(data_cfg(f, input_key="messages"), tokenizer, 0, want_response=True).next_batch(2)
    b = sft_batch(rows, tokenizer.eos_token_id, tokenizer.pad_token_id, 512)
    for i, conv in enumerate(CHAT):
        n = int(b.lengths[i])
        ids = b.tokens[i, :n].tolist()
        m = b.loss_mask[i, :n].tolist()
        # the whole conversation is the chat template's rendering
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(conv["messages"], tokenize=False)
        trained = tokenizer.decode([t for t, k in zip(ids, m) if k])
        want = "".join(x["content"] + tokenizer.eos_token for x in conv["messages"] if x["role"] == "assistant")
        assert trained == want
        # the prompt before the first assistant turn is exactly what a rollout prompt would be
        first = next(j for j, x in enumerate(conv["messages"]) if x["role"] == "assistant")
        prompt = tokenizer.apply_chat_template(conv["messages"][:first], tokenize=False, add_generation_prompt=True)
        assert rows[i].prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert m.index(1) == len(rows[i].prompt_ids)
    assert b.num_tokens == int(b.loss_mask.sum())


def test_chat_prompt_length_is_checked(tmp_path, tokenizer):
    from megaforge.data.sources import DataError

    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps(CHAT[0]))
    with pytest.raises(DataError, match="data.max_prompt_len"):
        PromptSource(data_cfg(f, input_key="messages", max_prompt_len=5), tokenizer, 0, want_response=True).next_batch(1)


def test_prompt_response_rows_mask_response_and_eos(tokenizer):
    from megaforge.config import DataConfig

    cfg = DataConfig(path="arithmetic", format="synthetic", synthetic_size=8, shuffle=False)
    rows = PromptSource(cfg, tokenizer, 0, want_response=True).next_batch(3)
    b = sft_batch(rows, tokenizer.eos_token_id, tokenizer.pad_token_id, 512)
    for i, r in enumerate(rows):
        n = int(b.lengths[i])
        p = len(r.prompt_ids)
        assert b.loss_mask[i, :p].sum() == 0 and b.loss_mask[i, n:].sum() == 0
        assert b.tokens[i, p:n].tolist() == list(r.response_ids) + [tokenizer.eos_token_id]
        assert b.loss_mask[i, p:n].sum() == n - p
    # max_len cuts rows, the cut part is not trained
    short = sft_batch(rows, tokenizer.eos_token_id, tokenizer.pad_token_id, 20)
    assert short.tokens.shape[1] == 20 and int(short.lengths.max()) == 20


def test_plan_bins():
    bins = plan_bins([5, 12, 3, 7, 12, 1, 4], 12)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum([5, 12, 3, 7, 12, 1, 4][i] for i in b) <= 12 for b in bins)
    assert len(bins) == 4  # 44 tokens: 12 | 12 | 7+5 | 4+3+1 (first-fit decreasing)
    with pytest.raises(ValueError, match="capacity"):
        plan_bins([13], 12)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(attn):
    from megaforge.config import load_config
    from megaforge.trainer.torch_backend import TorchTrainer

    cfg = load_config(["--config", SFT_CPU, "--model.config", f"{ROOT}/configs/models/tiny-qwen2",
                       "--model.attn_implementation", attn, "--trainer.device", "cpu"])
    t = TorchTrainer(RunBuilder(cfg).trainer_spec(), None)
    lens = torch.tensor([5, 12, 3, 7, 12, 1, 4, 2])
    T = 12
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 500, (len(lens), T), generator=g)
    tokens[torch.arange(T)[None] >= lens[:, None]] = 0
    from megaforge.types import TrainBatch

    mb = TrainBatch(tokens=tokens, lengths=lens, loss_mask=torch.ones(len(lens), T),
                    advantages=torch.zeros(len(lens), T), rollout_logprobs=torch.zeros(len(lens), T))
    with torch.no_grad():
        ref, _ = t._logprobs(t.module, mb, 1.0, False, trained=False)  # every position, unpacked
        for cap in (0, 24):  # rows of the longest example's length, and longer rows
            t.cfg.sft.pack_len = cap
            packed = t._forward_packed(t.module, mb, 1.0)
            assert torch.allclose(packed, ref, atol=1e-5), (cap, (packed - ref).abs().max())
    assert pack_rows(tokens, lens, 24).tokens.shape[0] < len(lens)  # several examples share a row
    # and attention really is blocked between documents: without restarts the result differs
    pk = pack_rows(tokens, lens, 24)
    with torch.no_grad():
        leaky = t.model(input_ids=pk.tokens, use_cache=False).logits
        clean = t.model(input_ids=pk.tokens, position_ids=pk.position_ids, use_cache=False).logits
    assert not torch.allclose(leaky, clean, atol=1e-3)


def test_sft_loss_decreases(tmp_path, in_root):
    run = run_launcher("sft", ["--config", SFT_CPU, "--sft.max_steps", "14", "--sft.batch_size", "16",
                               "--sft.warmup_steps", "2", "--trainer.micro_batch_size", "16",
                               "--metrics.progress", "false", "--metrics.tensorboard", "false"],
                       str(tmp_path), "sft")
    losses = [r["loss"] for r in read_metrics(run, "sft_metrics.jsonl")]
    assert len(losses) == 14
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:2]) / 2, losses


def test_chat_sft_runs_packed(tmp_path, in_root):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in CHAT * 4))
    run = run_launcher("sft", ["--config", SFT_CPU, "--sft.max_steps", "4", "--sft.batch_size", "4",
                               "--data.path", str(f), "--data.format", "jsonl", "--data.input_key", "messages",
                               "--metrics.progress", "false", "--metrics.tensorboard", "false"],
                       str(tmp_path), "chat")
    recs = read_metrics(run, "sft_metrics.jsonl")
    assert len(recs) == 4 and recs[-1]["loss"] < recs[0]["loss"]
