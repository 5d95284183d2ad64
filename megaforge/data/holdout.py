"""Prompt identity for held-out evaluation sets: one normal form per prompt, held-out prompt choice.

Two rows have the same prompt when the model sees the same prompt: their keys are equal. The key of
a prompt field (a string, or a list of ``{role, content}`` messages whose trailing assistant turns,
SFT targets, are left out) is

    normal_form(render(messages))      # a string is the one message [{role: user, content: it}]
                                       # each content in normal_form first (spaces at its ends dropped)

where ``render`` is what the model is given (the chat template's text when data applies one, see
:func:`megaforge.data.prompts.prompt_renderer`; else the messages' contents joined by newlines), and
:func:`normal_form` is NFKC, casefold, Unicode format characters (category Cf: zero-width space,
joiners, soft hyphen, BOM) removed, runs of whitespace collapsed to one space. So a one-message
chat list and its bare text, case, NFD/NFC, full-width digits and zero-width characters do not make
a training prompt look held out. A held-out fraction is drawn over *distinct* keys, so a prompt that
appears in several rows is either held out in all of them or in none.
"""
from __future__ import annotations

import random
import unicodedata
from typing import Any, Callable, Iterable, Optional


def normal_form(text: str) -> str:
    """``text`` compared as a prompt: NFKC, casefolded, without Cf characters, whitespace collapsed."""
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    return " ".join("".join(c for c in folded if unicodedata.category(c) != "Cf").split())


def prompt_messages(content: Any) -> Optional[list[dict]]:
    """The prompt's messages (a string is one user message; trailing assistant turns dropped); None
    when the field is neither a string nor a list of ``{role: str, content: str}`` (such a row fails
    its own validation later)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if isinstance(content, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                         and isinstance(m.get("content"), str) for m in content):
        msgs = list(content)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        return msgs or None
    return None


def plain_text(messages: list[dict]) -> str:
    """What the model sees without a chat template: the contents joined by newlines."""
    return "\n".join(m["content"] for m in messages)


def prompt_key(content: Any, render: Callable[[list[dict]], Optional[str]] = plain_text) -> Optional[str]:
    """The normal form of what the model sees for a prompt field; None for a field that is not a
    prompt, an empty one, or one ``render`` cannot render (returns None)."""
    msgs = prompt_messages(content)
    if msgs is None:
        return None
    msgs = [{**m, "content": normal_form(m["content"])} for m in msgs]  # also the space at either end
    if not any(m["content"] for m in msgs):
        return None
    text = render(msgs)
    return normal_form(text) or None if text is not None else None


def choose_held_out(keys: Iterable[str], fraction: float, seed: int) -> frozenset[str]:
    """``round(fraction * D)`` of the ``D`` distinct ``keys`` (at least 1, at most D - 1), drawn with
    ``seed`` independently of the order the keys come in."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"choose_held_out: fraction {fraction} is not in (0, 1)")
    distinct = sorted(set(keys))
    if len(distinct) < 2:
        raise ValueError(f"choose_held_out: {len(distinct)} distinct prompt(s): nothing to hold out and train on")
    n = min(max(1, round(fraction * len(distinct))), len(distinct) - 1)
    return frozenset(random.Random(seed).sample(distinct, n))
