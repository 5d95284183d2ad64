"""Prompt datasets for RL and SFT: row validation, chat templates, epoch shuffling, resumable position.

A :class:`PromptSource` yields :class:`PromptRow` batches. Its position (epoch, index into the
epoch's permutation, rows skipped) is in :meth:`PromptSource.state_dict`, so a resumed run sees
exactly the prompts an uninterrupted run would have seen.
"""
from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from megaforge.data.holdout import key_digest, prompt_key
from megaforge.data.sft import chat_sft_example
from megaforge.data.sources import DataError, RawRow, read_rows, row_table


@dataclass
class PromptRow:
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    where: str  # file and row, for messages
    response_ids: Optional[list[int]] = None  # SFT target (without the end-of-turn token)
    metadata: dict = field(default_factory=dict)
    # chat SFT: the whole conversation's ids and its loss mask (assistant turns); see data/sft.py
    sft_ids: Optional[list[int]] = None
    sft_mask: Optional[list[int]] = None


def chat_text(tokenizer, content, cfg) -> str:
    """The prompt text the model is given: a user turn (or given messages) through the chat template
    (data.apply_chat_template), else the messages' contents joined by newlines; data.system_prompt first."""
    if isinstance(content, list):
        messages = list(content)
    else:
        messages = [{"role": "user", "content": content}]
    if cfg.system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    if cfg.apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("data.apply_chat_template is true but the tokenizer has no chat template")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages)
    return text


def chat_prompt(tokenizer, content, cfg) -> tuple[str, list[int]]:
    """The prompt text (:func:`chat_text`) and its ids."""
    text = chat_text(tokenizer, content, cfg)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def rows_from_prompts(tokenizer, prompts: Sequence, data, labels: Optional[Sequence] = None) -> list:
    """Prompt rows from prompt texts or chat message lists through the chat template of the ``data``
    section (``data.apply_chat_template``, ``data.system_prompt``); ``labels``: each prompt's reference
    answer for the rewards. Rows given as PromptRow pass through (megaforge.api.prompt_rows)."""
    if isinstance(prompts, (str, dict)):
        raise TypeError("prompts must be a list (of texts, of chat message lists or of PromptRow), not one prompt")
    if labels is not None and len(labels) != len(prompts):
        raise ValueError(f"{len(labels)} labels for {len(prompts)} prompts")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, PromptRow):
            rows.append(p)
            continue
        if not isinstance(p, (str, list)):
            raise TypeError(f"prompts[{i}]: expected a text or a list of chat messages, not {type(p).__name__}")
        text, ids = chat_prompt(tokenizer, p, data)
        rows.append(PromptRow(ids, text, None if labels is None else labels[i], f"prompts[{i}]"))
    return rows


def prompt_renderer(tokenizer, cfg) -> Callable[[list[dict]], Optional[str]]:
    """``render`` for :func:`megaforge.data.holdout.prompt_key`: the text the model sees for messages
    under data config ``cfg``; None when they cannot be rendered (the row fails in :func:`parse_row`)."""
    def render(messages: list[dict]) -> Optional[str]:
        try:
            return chat_text(tokenizer, messages, cfg)
        except Exception:  # noqa: BLE001 - a template error on a bad row: reported by parse_row, naming it
            return None
    return render


def row_keys(rows: Sequence[RawRow], cfg, tokenizer) -> array:
    """``key_digest(prompt_key(...))`` of every row's prompt as the model sees it under data config
    ``cfg`` (0: the row has no prompt), one pass over ``rows``; kept in the memo of a
    :class:`megaforge.data.sources.JsonlIndex`, so the held-out split and the training data that
    leaves it out parse the file once."""
    sig = ("prompt_keys", id(tokenizer), getattr(tokenizer, "name_or_path", ""),
           str(getattr(tokenizer, "chat_template", None)), cfg.input_key, cfg.apply_chat_template, cfg.system_prompt)
    memo = getattr(rows, "memo", None)
    if memo is not None and sig in memo:
        return memo[sig]
    render = prompt_renderer(tokenizer, cfg)
    out = array("Q")
    for r in rows:
        k = prompt_key(r.data.get(cfg.input_key), render) if r.data is not None else None
        out.append(0 if k is None else key_digest(k))
    if memo is not None:
        memo[sig] = out
    return out


class _Picked(Sequence):
    """Rows ``ids`` of ``rows``, in order (the rows left for training)."""

    def __init__(self, rows: Sequence, ids: array):
        self.rows, self.ids = rows, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> RawRow:
        return self.rows[self.ids[i]]


def _check_messages(msgs, where: str, key: str):
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field {key!r} must be a non-empty string or list of messages")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key}[{j}] must be {{'role': str, 'content': str}}, got {m!r}")


def parse_row(raw: RawRow, cfg, tokenizer, want_response: bool) -> PromptRow:
    """Validate one raw row; raise DataError naming the row on any problem."""
    if raw.data is None:
        raise DataError(f"{raw.where}: {raw.error}")
    row = raw.data
    key = cfg.input_key
    if key not in row:
        raise DataError(f"{raw.where}: missing field {key!r} (data.input_key); row has {sorted(row)}")
    content = row[key]
    response_ids = None
    if isinstance(content, list):
        _check_messages(content, raw.where, key)
        if want_response and content[-1]["role"] == "assistant" and cfg.response_key not in row \
                and cfg.apply_chat_template:
            return _chat_sft_row(content, row.get(cfg.label_key), raw.where, cfg, tokenizer)
        if want_response and content[-1]["role"] == "assistant" and cfg.response_key not in row:
            response_ids = tokenizer(content[-1]["content"], add_special_tokens=False)["input_ids"]
            content = content[:-1]
            if not content:
                raise DataError(f"{raw.where}: {key!r} holds only an assistant message")
    elif not isinstance(content, str) or not content.strip():
        raise DataError(f"{raw.where}: field {key!r} must be a non-empty string, got {content!r}")
    label = row.get(cfg.label_key)
    if want_response and response_ids is None:
        resp = row.get(cfg.response_key)
        if not isinstance(resp, str) or not resp:
            raise DataError(f"{raw.where}: missing or empty field {cfg.response_key!r} (SFT target, data.response_key)")
        response_ids = tokenizer(resp, add_special_tokens=False)["input_ids"]
    if not want_response and label is None:
        raise DataError(f"{raw.where}: missing field {cfg.label_key!r} (data.label_key) for the rewards")
    text, ids = chat_prompt(tokenizer, content, cfg)
    if len(ids) > cfg.max_prompt_len:
        raise DataError(f"{raw.where}: prompt has {len(ids)} tokens > data.max_prompt_len {cfg.max_prompt_len}")
    if not ids:
        raise DataError(f"{raw.where}: the prompt tokenizes to nothing")
    return PromptRow(list(ids), text, label, raw.where, response_ids)


def _chat_sft_row(messages, label, where: str, cfg, tokenizer) -> PromptRow:
    """A chat conversation for SFT: trained on every assistant turn (data/sft.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data.apply_chat_template is true but the tokenizer has no chat template")
    if cfg.system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": cfg.system_prompt}] + list(messages)
    ids, mask, prompt_text = chat_sft_example(tokenizer, messages, where)
    n_prompt = mask.index(1)
    if n_prompt > cfg.max_prompt_len:
        raise DataError(f"{where}: prompt has {n_prompt} tokens > data.max_prompt_len {cfg.max_prompt_len}")
    return PromptRow(ids[:n_prompt], prompt_text, label, where, sft_ids=ids, sft_mask=mask)


class PromptSource:
    """Batches of validated prompts; map-style (shuffled per epoch) or streaming (in order)."""

    def __init__(self, cfg, tokenizer, seed: int, want_response: bool = False,
                 exclude: frozenset = frozenset()):
        """``exclude``: digests of held-out prompts (:func:`row_keys`); their rows are left out
        (map-style data only; counted in ``held_out``). Map-style ``.jsonl`` data is indexed, not
        loaded (:func:`megaforge.data.sources.row_table`)."""
        self.cfg, self.tok, self.seed, self.want_response = cfg, tokenizer, seed, want_response
        self.streaming = cfg.streaming
        self.epoch, self.pos, self.skipped = 0, 0, 0
        self._stream: Optional[Iterator[RawRow]] = None
        self.held_out = 0
        if exclude and self.streaming:
            raise DataError(f"data.path {cfg.path!r}: held-out prompts need map-style data (data.streaming false)")
        if self.streaming:
            self._rows: list[RawRow] = []
        else:
            rows = row_table(cfg, seed)
            self._rows = rows
            if exclude:
                keys = row_keys(rows, cfg, tokenizer)
                self._rows = _Picked(rows, array("I", (i for i, k in enumerate(keys) if k not in exclude)))
            self.held_out = len(rows) - len(self._rows)
            if not self._rows:
                raise DataError(f"data.path {cfg.path!r}: no rows" + (f" ({self.held_out} held out)" if self.held_out else ""))
            self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self._rows)

    def _permutation(self, epoch: int) -> array:
        order = array("I", range(len(self._rows)))  # 4 bytes a row; shuffled as a list would be
        if self.cfg.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _next_raw(self) -> RawRow:
        if self.streaming:
            if self._stream is None:
                self._stream = read_rows(self.cfg, self.seed)
                for _ in range(self.pos):  # resume: skip what was consumed
                    next(self._stream)
            try:
                raw = next(self._stream)
            except StopIteration:
                self.epoch += 1
                self.pos = 0
                self._stream = read_rows(self.cfg, self.seed)
                try:
                    raw = next(self._stream)
                except StopIteration:
                    raise DataError(f"data.path {self.cfg.path!r}: no rows") from None
            self.pos += 1
            return raw
        if self.pos >= len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._permutation(self.epoch)
        raw = self._rows[self._order[self.pos]]
        self.pos += 1
        return raw

    def next_batch(self, n: int) -> list[PromptRow]:
        out: list[PromptRow] = []
        tries = 0
        limit = max(10 * n, len(self._rows) + n)
        while len(out) < n:
            raw = self._next_raw()
            try:
                out.append(parse_row(raw, self.cfg, self.tok, self.want_response))
            except DataError:
                if not self.cfg.skip_bad_rows:
                    raise
                self.skipped += 1
                tries += 1
                if tries > limit:
                    raise DataError(f"data.path {self.cfg.path!r}: more than {limit} bad rows in a row") from None
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos, self.skipped = int(state["epoch"]), int(state["pos"]), int(state["skipped"])
        if self.streaming:
            self._stream = None
        else:
            self._order = self._permutation(self.epoch)
