"""The learned reward model: a tiny random Qwen2ForSequenceClassification scored in batches on CPU,
against an unpadded one-sequence reference; the chat template and the truncation policy; the model
in its own reward worker, and served over HTTP."""

import pytest
import torch

from megaforge.config import RewardModelConfig, RewardsConfig, RewardSpec
from megaforge.rewards import RewardManager
from megaforge.rewards.remote import RemoteReward
from megaforge.rewards.reward_model import RewardModel
from model_helpers import make_tiny_reward_model
from service_helpers import serve

# float32, 2 layers of width 64: a padded batch and a lone sequence differ by the order of a few
# float32 roundings of O(1) sums (~1e-6); 1e-4 covers that with room and is far below the spread of
# the scores (~0.1 - 1)
TOL = 1e-4
PROMPTS = ["What is 2+3?", "Name a colour.", "p", "Say hi"]
RESPONSES = ["<think>2+3=5</think> \\boxed{5}", "blue", "a much longer answer " * 5, "hi<|endoftext|>"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_tiny_reward_model(str(tmp_path_factory.mktemp("tiny-rm")))


def reference(rm: RewardModel, ids: list[int]) -> float:
    """The score of one unpadded sequence: the head on the base model's last hidden state."""
    with torch.no_grad():
        h = rm.model.model(input_ids=torch.tensor([ids])).last_hidden_state[:, -1]
        return float(rm.model.score(h)[0, 0])


def test_batched_scores_equal_the_one_sequence_reference(rm_dir):
    for template in ("chat", "concat"):
        rm = RewardModel(rm_dir, template=template, batch_size=3)
        got = rm.score_batch(PROMPTS, RESPONSES, [None] * 4)
        want = [reference(rm, rm.encode(p, r)) for p, r in zip(PROMPTS, RESPONSES)]
        assert got == pytest.approx(want, abs=TOL)
        assert len(set(round(v, 3) for v in got)) == 4  # the samples are told apart
    # concat: "hi<|endoftext|>" ends in the pad id (0); it is still scored at its last token
    assert rm.encode("Say hi", "hi<|endoftext|>")[-1] == rm.pad_id == 0


def test_chat_template_of_the_reward_models_tokenizer_and_truncation(rm_dir):
    rm = RewardModel(rm_dir, template="chat", max_length=12)
    text = rm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"},
                                             {"role": "assistant", "content": "5"}], tokenize=False)
    full = rm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert text.startswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>")
    assert len(full) > 12 and rm.encode("What is 2+3?", "5") == full[-12:]  # the last max_length tokens
    assert rm("What is 2+3?", "5") == pytest.approx(reference(rm, full[-12:]), abs=TOL)


def test_a_checkpoint_with_several_outputs_or_none_is_refused(rm_dir, tmp_path):
    two = make_tiny_reward_model(str(tmp_path / "two"), num_labels=2)
    with pytest.raises(ValueError, match=r"num_labels=2; a reward model has one output"):
        RewardModel(two)
    with pytest.raises(ValueError, match=r"reward_model.path '.*nowhere': cannot load"):
        RewardModel(str(tmp_path / "nowhere"))


def test_in_its_own_worker_and_served_over_http(rm_dir):
    direct = RewardModel(rm_dir, batch_size=2).score_batch(PROMPTS, RESPONSES, [None] * 4)
    spec = RewardSpec("reward_model", reward_model=RewardModelConfig(path=rm_dir, batch_size=2))
    m = RewardManager(RewardsConfig(functions=[RewardSpec("math"), spec], workers=1))
    try:
        assert len(m.pools) == 2 and m.pools[1].base == 1 and m.pools[1].batch_sizes == [2]
        totals, metrics = m.score(PROMPTS, RESPONSES, ["5", "x", "y", "z"])
        assert totals == pytest.approx([1.0 + direct[0]] + direct[1:], abs=TOL)
        assert metrics["reward/errors"] == 0
    finally:
        m.close()
    with serve("--spec", f"{{name: reward_model, reward_model: {{path: {rm_dir}, batch_size: 2}}}}") as (url, _):
        client = RemoteReward(url, batch_size=3)
        try:
            assert client.score_batch(PROMPTS, RESPONSES, [None] * 4) == pytest.approx(direct, abs=TOL)
        finally:
            client.close()
