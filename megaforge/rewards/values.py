"""What a reward value may be: one rule for the reward workers, the reward service and its client.

A reward value is a real number (``int``, ``float``, or a NumPy integer / floating scalar: any
``numbers.Real``) that is finite and within ``[-REWARD_BOUND, REWARD_BOUND]``. Refused, each with
a ``ValueError`` saying what came back: a ``bool`` (``True`` is not a score: return ``1.0``), a
string (``"0.75"`` is not parsed), ``None`` and any other object (a tensor: return ``.item()``),
NaN and infinities, an integer too large for a float, and anything beyond the bound (advantages
square rewards: 1e300 would overflow them; no reward needs more than a million).
"""
from __future__ import annotations

import math
import numbers
from typing import Any

REWARD_BOUND = 1e6


def _shown(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:80] + "..."


def reward_value(v: Any) -> float:
    """``float(v)`` for a valid reward value (see the module docstring); ValueError otherwise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy.bool_ is no numbers.Real
        raise ValueError(f"returned {type(v).__name__} {_shown(v)}, not a number (rewards are real numbers: "
                         f"strings and bools are refused)")
    try:
        x = float(v)
    except OverflowError:
        raise ValueError(f"returned an integer of {int(v).bit_length()} bits, beyond the reward bound "
                         f"{REWARD_BOUND:g}") from None
    if not math.isfinite(x):
        raise ValueError(f"returned {x}")
    if abs(x) > REWARD_BOUND:
        raise ValueError(f"returned {x:g}, beyond the reward bound [-{REWARD_BOUND:g}, {REWARD_BOUND:g}]")
    return x
