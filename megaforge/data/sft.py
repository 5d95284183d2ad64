"""Chat SFT examples: a conversation through the chat template, trained on the assistant turns only.

For messages ``m_0 .. m_n`` the text is ``apply_chat_template(messages)``; assistant turn ``i`` spans
from the end of ``apply_chat_template(m_0..m_{i-1}, add_generation_prompt=True)`` (what the model
sees when it starts answering) through the first end-of-turn token (the tokenizer's EOS, which is
what the rollout engines stop on) after the turn's content. Tokens inside those spans get
``loss_mask`` 1; system / user / tool turns, the template's role headers and anything after the
end-of-turn token (e.g. a newline) get 0. The template must be prefix-consistent (every shorter
conversation renders as a prefix of the longer one), which every common chat template is; a template
that is not is reported with the row.
"""
from __future__ import annotations

from megaforge.data.sources import DataError


def _render(tokenizer, messages, gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def assistant_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(full text, character spans [start, end) of the trained part of every assistant turn)."""
    full = _render(tokenizer, messages, False)
    eos = tokenizer.eos_token or ""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[:i + 1], False)
        if not (full.startswith(upto) and upto.startswith(head)):
            raise DataError(f"{where}: the chat template is not prefix-consistent at message {i}; "
                            "cannot locate the assistant turn (use prompt/response rows instead)")
        start = len(head)
        body = upto.find(m["content"], start)
        if body < 0:
            raise DataError(f"{where}: assistant message {i} does not appear in the rendered chat template")
        body_end = body + len(m["content"])
        stop = upto.find(eos, body_end) if eos else -1
        end = stop + len(eos) if stop >= 0 else len(upto)
        spans.append((start, end))
    if not spans:
        raise DataError(f"{where}: no assistant message to train on")
    return full, spans


def chat_sft_example(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int], str]:
    """(token ids, loss mask, prompt text before the first assistant turn) of a conversation.

    The text is tokenized segment by segment (context, turn, context, ...), so the context before
    each turn has exactly the ids a prompt rendered to that point gets at rollout time, and each
    turn the ids of its text on its own."""
    full, spans = assistant_spans(tokenizer, messages, where)
    ids: list[int] = []
    mask: list[int] = []
    at = 0
    for s, e in spans:
        for text, m in ((full[at:s], 0), (full[s:e], 1)):
            if text:
                seg = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids.extend(seg)
                mask.extend([m] * len(seg))
        at = e
    if full[at:]:
        tail = tokenizer(full[at:], add_special_tokens=False)["input_ids"]
        ids.extend(tail)
        mask.extend([0] * len(tail))
    return ids, mask, full[:spans[0][0]]
