"""The tool-use example's task: 2-digit multiplication, with a calculator to call.

Registered as the synthetic task ``tool_multiplication`` when this module is imported (the example's
config lists it under ``algo.plugins``, which megaforge imports at start-up). Rows:

    prompt   "What is 47 * 86?"
    answer   "4042"                                   (the label the math reward checks)
    response a worked answer for the SFT warm start, one of
             "<tool>calculator: 47*86</tool><result>4042</result> \\boxed{4042}"   (tool_fraction of rows)
             "\\boxed{4042}"                                                       (the rest: a direct answer)

The tiny model cannot multiply 2-digit numbers in its head, so after SFT its direct answers are
mostly wrong and its tool calls mostly right: GRPO with the math reward on the whole episode
(``rollout.generate_fn: megaforge.rollout.agent.multiturn:tool_rollout``) learns to call the tool.
In SFT the whole trace is trained (the result tokens too); in RL the result comes from the tool and
is never trained (response_mask 0).
"""
from __future__ import annotations

import random

from megaforge.data.synthetic import SYNTHETIC_TASKS


def tool_trace(a: int, b: int) -> str:
    return f"<tool>calculator: {a}*{b}</tool><result>{a * b}</result> \\boxed{{{a * b}}}"


@SYNTHETIC_TASKS.register("tool_multiplication")
def tool_multiplication_rows(n: int, seed: int = 0, min_operand: int = 10, max_operand: int = 99,
                             tool_fraction: float = 0.3) -> list[dict]:
    """``n`` rows of ``a * b`` with operands in [min_operand, max_operand]; a ``tool_fraction`` of
    the SFT responses call the calculator, the others answer directly."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_multiplication: tool_fraction {tool_fraction} is not in [0, 1]")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        tool = rng.random() < tool_fraction
        rows.append({"id": i, "prompt": f"What is {a} * {b}?", "answer": str(a * b),
                     "response": tool_trace(a, b) if tool else f"\\boxed{{{a * b}}}"})
    return rows
