"""Verifiable rewards: final-answer correctness and output format.

Reward callables follow torchforge's signature ``reward(prompt: str, response: str, target) -> float``.

Bounded grading: math-verify evaluates what it compares, and a 17-character answer such as
``9^{9^{9}}`` (an integer of 370 million digits) holds the interpreter for minutes in one C call
that no signal interrupts. So every parsed answer is sized first (:func:`answer_digits`: an upper
bound of the digits its numbers reach, from literals, powers and factorials, without evaluating
anything); an answer over ``MAX_ANSWER_DIGITS`` is not compared and grades as incorrect. Whatever
else is slow is bounded by the caller: the reward workers kill a call at ``rewards.timeout_s``
(:mod:`megaforge.rewards.executor`, which ``python -m megaforge.rewards.serve`` uses too).
"""
from __future__ import annotations

import logging
import math
import re
from typing import Optional

_NUM = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_GSM8K = re.compile(r"####\s*([^\n]+)")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    idx = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if idx < 0:
        return None
    i = text.index("{", idx) + 1
    depth, start = 1, i
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
        i += 1
    return None  # unbalanced


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a response or a reference: last \\boxed{}, else GSM8K's ``#### N``."""
    if text is None:
        return None
    text = str(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    m = _GSM8K.findall(text)
    if m:
        return m[-1].strip()
    return None


def normalize(ans: str) -> str:
    s = ans.strip().strip("$").strip()
    s = s.replace(",", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.rstrip(".").strip()
    return s


MAX_ANSWER_DIGITS = 10_000


def answer_digits(expr) -> float:
    """An upper bound of the decimal digits the numbers of a sympy expression reach when evaluated
    (``inf`` beyond ~1e300), read from its tree without evaluating it: a literal n has ``log10|n|``
    (0 below 2); ``b**e`` has ``|e| * digits(b)``, where ``|e|`` is the exponent's value when it is a
    literal, else ``10**digits(e)`` (a negative exponent makes a denominator as large); ``n!`` has
    ``|n| * digits(n)`` likewise; anything else the sum over its arguments (a symbol: 1)."""
    import sympy

    if isinstance(expr, (sympy.Integer, int)):
        n = abs(int(expr))
        return math.log10(n) if n >= 2 else 0.0
    if isinstance(expr, sympy.Rational):
        return answer_digits(expr.p) + answer_digits(expr.q)
    if isinstance(expr, (sympy.Float, float)):
        x = abs(float(expr))
        return math.log10(x) if x >= 2 else 0.0
    if isinstance(expr, (sympy.Pow, sympy.factorial)):
        base, exp = (expr.args[0], expr.args[0]) if isinstance(expr, sympy.factorial) else expr.args
        if isinstance(exp, (sympy.Rational, sympy.Float)):
            try:
                size = abs(float(exp))
            except OverflowError:
                return math.inf
        else:
            e = answer_digits(exp)
            size = math.inf if e > 300 else 10 ** e
        b = answer_digits(base)
        return math.inf if math.isinf(size) else size * b
    args = expr if isinstance(expr, (list, tuple, set, frozenset)) else getattr(expr, "args", ())
    return float(sum(answer_digits(a) for a in args)) if args else 1.0


def too_large(parsed) -> bool:
    """Whether a math-verify parse (a list of sympy expressions and strings) is over MAX_ANSWER_DIGITS."""
    import sympy

    return any(answer_digits(x) > MAX_ANSWER_DIGITS for x in parsed if isinstance(x, sympy.Basic))


def answers_equal(pred: str, gold: str, use_math_verify: bool = True) -> bool:
    """Exact after normalisation; numbers compared numerically; otherwise math-verify equivalence
    (False for an answer over MAX_ANSWER_DIGITS: see the module docstring)."""
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    if _NUM.match(p) and _NUM.match(g):
        return abs(float(p) - float(g)) <= 1e-9 * max(1.0, abs(float(g)))
    if not use_math_verify:
        return False
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise RuntimeError("MathReward needs math-verify for symbolic answers: pip install math-verify") from e
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # megaforge's reward executor bounds the time of each call (it kills the worker process);
    # math-verify's own signal-based timeouts are off so that they do not touch the caller's signals.
    gold_parsed = parse(f"${g}$", parsing_timeout=None)
    pred_parsed = parse(f"${p}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed or too_large(gold_parsed) or too_large(pred_parsed):
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


class MathReward:
    """1.0 when the response's final answer (last ``\\boxed{}``, else ``#### N``) equals the target.

    The target may be a bare answer, a GSM8K solution ending in ``#### N``, or text with a
    ``\\boxed{}``. Equality: normalised strings, numbers numerically, else math-verify.
    """

    def __init__(self, correct: float = 1.0, incorrect: float = 0.0, use_math_verify: bool = True):
        self.correct, self.incorrect, self.use_math_verify = correct, incorrect, use_math_verify
        if use_math_verify:  # import it now (sympy: ~1 s), not inside the first timed call of a step
            try:
                import math_verify  # noqa: F401
            except ImportError:  # only symbolic answers need it: answers_equal says so when one comes
                pass

    def __call__(self, prompt: str, response: str, target) -> float:
        pred = extract_answer(response)
        if pred is None:
            return self.incorrect
        gold = extract_answer(str(target))
        if gold is None:
            gold = str(target)
        return self.correct if answers_equal(pred, gold, self.use_math_verify) else self.incorrect


class ThinkingReward:
    """Format reward: ``reward`` when the response is ``<think>...</think>`` (non-empty reasoning)
    followed by a final answer (``\\boxed{}`` when ``require_answer``), else 0."""

    def __init__(self, reward: float = 1.0, require_answer: bool = True,
                 open_tag: str = "<think>", close_tag: str = "</think>"):
        self.reward, self.require_answer = reward, require_answer
        self.pattern = re.compile(
            r"^\s*" + re.escape(open_tag) + r"(?P<think>.+?)" + re.escape(close_tag) + r"(?P<rest>.*)$", re.S
        )
        self.open_tag, self.close_tag = open_tag, close_tag

    def __call__(self, prompt: str, response: str, target=None) -> float:
        m = self.pattern.match(response)
        if not m or not m.group("think").strip():
            return 0.0
        rest = m.group("rest")
        if self.open_tag in rest or self.close_tag in rest:
            return 0.0
        if self.require_answer and last_boxed(rest) is None:
            return 0.0
        return self.reward
