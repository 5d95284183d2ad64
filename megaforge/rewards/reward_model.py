"""A learned reward model: a Hugging Face ``AutoModelForSequenceClassification`` checkpoint with one
output (``num_labels == 1``, e.g. Qwen2ForSequenceClassification, LlamaForSequenceClassification),
``rewards.functions: [{name: reward_model, reward_model: {path: ..., device: cuda:1}}]``.

It runs in a reward worker of its own (one copy of the model, on ``reward_model.device``) or behind
``python -m megaforge.rewards.serve --spec '{name: reward_model, reward_model: {...}}'``.

Input of one sample (the reward model's tokenizer, not the policy's):

* ``template: chat``: ``apply_chat_template([{user: prompt}, {assistant: response}])`` (no generation
  prompt), tokenized without extra special tokens; ``concat``: ``prompt + response`` tokenized with
  the tokenizer's special tokens (e.g. a BOS).
* Truncation: a sequence longer than ``max_length`` keeps its last ``max_length`` tokens. The score
  is read at the last token, so the end of the response is always seen; the start of the prompt is
  what goes.

Scoring: sequences sorted by length, in forward passes of ``batch_size``, left-padded (every row's
last token is the batch's last position; padded positions are masked out of attention and their
position ids do not count), the model fed embeddings so that it reads every row's score at the last
position whatever token ids the sequence holds (from ids, transformers pools at the last token that
is not the pad id, which misreads a sequence that ends in that id). Reward = that output (float32).
"""
from __future__ import annotations

import logging
from typing import Sequence


class RewardModel:
    """See the module docstring. A batched reward (``score_batch``, ``batch_size``)."""

    def __init__(self, path: str, tokenizer: str = "", device: str = "cpu", dtype: str = "float32",
                 template: str = "chat", max_length: int = 2048, batch_size: int = 16, trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from megaforge.hf import DTYPES, resolve_device  # lazy: torch; reward workers import this module at start-up

        if template not in ("chat", "concat"):
            raise ValueError(f"reward_model.template {template!r}: valid: chat, concat")
        if max_length < 2 or batch_size < 1:
            raise ValueError(f"reward_model: need max_length >= 2 and batch_size >= 1 (got {max_length}, {batch_size})")
        self.path, self.template, self.max_length, self.batch_size = path, template, int(max_length), int(batch_size)
        self.device = resolve_device(device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or path, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code).to(self.device).eval()
        except (OSError, ValueError) as e:
            raise ValueError(f"reward_model.path {path!r}: cannot load a sequence-classification checkpoint: {e}") from e
        labels = int(getattr(self.model.config, "num_labels", 0))
        if labels != 1:
            raise ValueError(f"reward_model.path {path!r}: the model has num_labels={labels}; a reward model has one "
                             f"output (num_labels=1)")
        if template == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward_model.template chat: the tokenizer of {tokenizer or path!r} has no chat template "
                             f"(use template: concat)")
        vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < (vocab or pad + 1) else 0  # masked out: any id does
        self._torch = torch
        # transformers warns that it "will not detect padding tokens in inputs_embeds": left padding is why
        logging.getLogger("transformers.modeling_layers").setLevel(logging.ERROR)

    @classmethod
    def from_spec(cls, spec) -> "RewardModel":
        rm = spec.reward_model
        return cls(rm.path, rm.tokenizer, rm.device, rm.dtype, rm.template, rm.max_length, rm.batch_size,
                   rm.trust_remote_code)

    def encode(self, prompt: str, response: str) -> list[int]:
        """The token ids scored for one sample (see the module docstring), truncated to max_length."""
        if self.template == "chat":
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt + response)["input_ids"]
        if not ids:
            raise ValueError("the sample tokenizes to nothing")
        return list(ids[-self.max_length:])

    def __call__(self, prompt: str, response: str, target=None) -> float:
        return self.score_batch([prompt], [response], [target])[0]

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence = ()) -> list[float]:
        seqs = [self.encode(p, r) for p, r in zip(prompts, responses)]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        out = [0.0] * len(seqs)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            for i, v in zip(idx, self.forward([seqs[i] for i in idx])):
                out[i] = v
        return out

    def forward(self, seqs: list[list[int]]) -> list[float]:
        """Scores of one batch of token sequences (left-padded, read at the last position)."""
        torch = self._torch
        L = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for b, x in enumerate(seqs):
            ids[b, L - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[b, L - len(x):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(ids)
            logits = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).logits
        return logits[:, 0].float().cpu().tolist()
