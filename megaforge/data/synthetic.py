"""Verifiable tasks generated in code, so the demo and the tests need no download.

``arithmetic``: "What is 7 + 5?" answered as ``<think>7+5=12</think> \\boxed{12}``. Rows carry
``prompt``, ``answer`` (the label the rewards check) and ``response`` (a correct worked answer, used
by the SFT warm start). With ``boxed_fraction < 1`` some worked answers end in plain prose
("The answer is 12.") instead of the boxed form the rewards verify, as mixed-style SFT data does:
an SFT'd model then boxes only part of the time, and RL has to learn the verifiable format.
"""
from __future__ import annotations

import random
from typing import Callable

from megaforge.registry import Registry

SYNTHETIC_TASKS = Registry("synthetic task")


@SYNTHETIC_TASKS.register("arithmetic")
def arithmetic_rows(n: int, seed: int = 0, max_operand: int = 9, ops: str = "+-", min_operand: int = 0,
                    boxed_fraction: float = 1.0) -> list[dict]:
    """``n`` rows of ``a op b`` with operands in [min_operand, max_operand] and op drawn from ``ops``;
    a ``boxed_fraction`` of the worked responses put the answer in ``\\boxed{}``."""
    bad = set(ops) - set("+-*")
    if bad:
        raise ValueError(f"arithmetic task: unsupported operator(s) {sorted(bad)}; use some of '+-*'")
    if not 0.0 <= boxed_fraction <= 1.0:
        raise ValueError(f"arithmetic task: boxed_fraction {boxed_fraction} is not in [0, 1]")
    if max_operand < min_operand:
        raise ValueError(f"arithmetic task: max_operand {max_operand} < min_operand {min_operand}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a = rng.randint(min_operand, max_operand)
        b = rng.randint(min_operand, max_operand)
        op = rng.choice(ops)
        c = a + b if op == "+" else a - b if op == "-" else a * b
        boxed = rng.random() < boxed_fraction
        final = f"\\boxed{{{c}}}" if boxed else f"The answer is {c}."
        rows.append({
            "id": i,
            "prompt": f"What is {a} {op} {b}?",
            "answer": str(c),
            "response": f"<think>{a}{op}{b}={c}</think> {final}",
        })
    return rows


def synthetic_rows(name: str, n: int, seed: int, **kwargs) -> list[dict]:
    fn: Callable[..., list[dict]] = SYNTHETIC_TASKS.get(name)
    try:
        return fn(n, seed=seed, **kwargs)
    except TypeError as e:
        raise ValueError(f"synthetic task {name!r}: bad data.synthetic_kwargs {kwargs}: {e}") from e
