"""Prompt identity for held-out evaluation sets: a normalised key per prompt, held-out prompt choice.

Two rows have the same prompt when their keys are equal: the prompt text with runs of whitespace
collapsed to one space (a list of chat messages: ``role: content`` per message, trailing assistant
turns — SFT targets — left out). A held-out fraction is drawn over *distinct* prompts, so a prompt
that appears in several rows is either held out in all of them or in none.
"""
from __future__ import annotations

import random
from typing import Any, Iterable, Optional


def prompt_key(content: Any) -> Optional[str]:
    """The normalised key of a prompt field (a string or a list of ``{role, content}`` messages);
    None when the field is neither (such a row fails its own validation later)."""
    if isinstance(content, str):
        key = " ".join(content.split())
        return key or None
    if isinstance(content, list) and all(isinstance(m, dict) for m in content):
        msgs = list(content)
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()
        parts = [f"{m.get('role')}: {' '.join(str(m.get('content', '')).split())}" for m in msgs]
        return "\n".join(parts) or None
    return None


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
