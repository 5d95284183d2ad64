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
appears in several rows is either held out in all of them or in none. Sets of prompts are held as
:func:`key_digest` (64 bits a prompt, whatever its length; n distinct prompts collide with
probability about n^2 / 2^65, 3e-8 for a million).
"""
from __future__ import annotations

import hashlib
import random
import unicodedata
from array import array
from typing import Any, Callable, Iterable, Optional, Union


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


def key_digest(key: str) -> int:
    """A prompt key as a nonzero 64-bit integer (blake2b; 0 stands for "no prompt")."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little") or 1


def choose_held_out(keys: Union[Iterable, array], fraction: float, seed: int) -> frozenset:
    """``round(fraction * D)`` of the ``D`` distinct ``keys`` (at least 1, at most D - 1), drawn with
    ``seed`` independently of the order the keys come in. ``keys``: any iterable of keys, or an
    ``array("Q")`` of :func:`key_digest` values (0, no prompt, left out), made distinct in 8 bytes a
    row (numpy) instead of a Python set of them."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"choose_held_out: fraction {fraction} is not in (0, 1)")
    if isinstance(keys, array):
        import numpy as np

        distinct = np.unique(np.frombuffer(keys, dtype=np.uint64) if len(keys) else np.zeros(0, np.uint64))
        distinct = distinct[distinct != 0]
    else:
        distinct = sorted(set(keys))
    if len(distinct) < 2:
        raise ValueError(f"choose_held_out: {len(distinct)} distinct prompt(s): nothing to hold out and train on")
    n = min(max(1, round(fraction * len(distinct))), len(distinct) - 1)
    picked = random.Random(seed).sample(range(len(distinct)), n)  # the positions sample(distinct, n) would take
    return frozenset(int(distinct[i]) if isinstance(keys, array) else distinct[i] for i in picked)
