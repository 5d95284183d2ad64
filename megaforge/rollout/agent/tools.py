"""Tools a model can call between turns, and the call syntax.

A call is ``<tool>NAME: ARGS</tool>`` in the model's turn (generation stops at ``</tool>``); the
environment answers ``<result>OUTPUT</result>`` (see :class:`megaforge.rollout.agent.multiturn.ToolEnv`).
A tool is any callable ``tool(args: str) -> str``; it reports bad input as text (``error: ...``), which
the model then sees, and never raises for it.

Registered: ``calculator`` (:class:`Calculator`, exact arithmetic over an expression tree, no
``eval``) and ``python`` (:class:`PythonTool`, code run by :func:`megaforge.rollout.agent.sandbox.run_code`).
A user tool is ``package.module:callable`` (a class is instantiated with its kwargs).
"""
from __future__ import annotations

import ast
import inspect
import operator
import re
from typing import Callable, Optional

from megaforge.registry import Registry
from megaforge.rollout.agent.sandbox import require, run_code

TOOLS = Registry("tool")


def parse_call(text: str, open_tag: str = "<tool>", close_tag: str = "</tool>") -> Optional[tuple[str, str]]:
    """(name, args) of the last complete call in ``text``, or None. ``NAME`` is an identifier; the
    arguments are everything after the first ``:`` up to the close tag, stripped."""
    end = text.rfind(close_tag)
    if end < 0:
        return None
    start = text.rfind(open_tag, 0, end)
    if start < 0:
        return None
    body = text[start + len(open_tag): end]
    m = re.match(r"\s*([A-Za-z_][\w.-]*)\s*:(.*)\Z", body, re.S)
    if not m:
        return None
    return m.group(1), m.group(2).strip()


@TOOLS.register("calculator")
class Calculator:
    """Arithmetic on numbers: ``+ - * / // % **`` and parentheses, ints exact, floats rounded to
    ``digits`` significant digits. Exponents are limited to ``max_exponent`` and results to
    ``max_digits`` digits, so a call cannot exhaust memory."""

    _BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
            ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    _UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}

    def __init__(self, max_exponent: int = 64, max_digits: int = 64, digits: int = 12, max_len: int = 200):
        self.max_exponent, self.max_digits, self.digits, self.max_len = max_exponent, max_digits, digits, max_len

    def __call__(self, args: str) -> str:
        expr = args.strip().replace("×", "*").replace("^", "**")
        if not expr or len(expr) > self.max_len:
            return "error: empty expression" if not expr else f"error: expression longer than {self.max_len} characters"
        try:
            v = self._eval(ast.parse(expr, mode="eval").body)
        except ZeroDivisionError:
            return "error: division by zero"
        except (SyntaxError, ValueError, TypeError, OverflowError) as e:
            return f"error: {e}" if str(e) else "error: invalid expression"
        if isinstance(v, float):
            if v.is_integer() and abs(v) < 1e15:
                return str(int(v))
            return f"{v:.{self.digits}g}"
        return str(v)

    def _eval(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._UN:
            return self._UN[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self._BIN:
            a, b = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > self.max_exponent:
                raise ValueError(f"exponent larger than {self.max_exponent}")
            v = self._BIN[type(node.op)](a, b)
            if isinstance(v, complex):
                raise ValueError("complex result")
            if isinstance(v, int) and len(str(abs(v))) > self.max_digits:
                raise ValueError(f"result longer than {self.max_digits} digits")
            return v
        raise ValueError(f"unsupported syntax: {type(node).__name__}")


@TOOLS.register("python")
class PythonTool:
    """Runs the call's arguments as Python code in the sandbox; answers its stdout (stripped), or
    ``error: <last line of stderr>`` (e.g. ``MemoryError``, ``TimeoutError: ...``). Built only where
    the sandbox works (:func:`megaforge.rollout.agent.sandbox.require`, which logs its isolation): a
    machine that cannot isolate the code fails at start-up, not in the middle of a rollout."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 2048):
        self.timeout_s, self.memory_mb, self.max_output_bytes = timeout_s, memory_mb, max_output_bytes
        require()

    def __call__(self, args: str) -> str:
        code = args.strip()
        if code.startswith("```"):  # a fenced block: drop the fences
            code = re.sub(r"^```\w*\n?|```$", "", code).strip()
        res = run_code(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output_bytes=self.max_output_bytes)
        if res.ok:
            return res.stdout.strip()
        lines = [l for l in res.stderr.strip().splitlines() if l.strip()]
        return "error: " + (lines[-1].strip() if lines else f"exit status {res.returncode}")


def build_tools(specs) -> dict[str, Callable[[str], str]]:
    """``{name: tool}`` from a list of names (``calculator``), ``package.module:callable`` paths, or
    ``{name: ..., kwargs: {...}}`` dicts (rollout.generate_kwargs ``tools``)."""
    out = {}
    for spec in specs:
        name, kwargs = (spec, {}) if isinstance(spec, str) else (spec["name"], dict(spec.get("kwargs") or {}))
        obj = TOOLS.get(name)
        tool = obj(**kwargs) if inspect.isclass(obj) else obj
        out[name.rsplit(":", 1)[-1]] = tool
    if not out:
        raise ValueError("rollout.generate_kwargs.tools is empty: give at least one tool")
    return out
