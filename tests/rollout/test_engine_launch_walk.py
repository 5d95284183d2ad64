"""Issue 42 point 7: the config's walk from the engine placement to the engine launch has at most 3
returns. A real trace (``sys.setprofile``) of :func:`megaforge.placement.build_engines` on one CPU
process, ``rollout.engine: embedded_server`` (one engine, 127.0.0.1, ``model.path`` set: the
defaults of tests/rollout/engine_helpers.engine_config; then two engines, host 0.0.0.0, an API key), up to the entry of
:meth:`megaforge.rollout.http.processes.ServerProcess.start`, which is patched to raise a sentinel
(no server is started).

What is measured, between build_engines' entry and ServerProcess.start's entry:

* the *walk*: the megaforge functions called (code under the megaforge package). A comprehension's
  frame belongs to the function that holds it (Python 3.12 inlines them, PEP 709), so it is neither a
  function nor a call nor a return of its own. The engine kind's module is imported before the trace:
  what is traced is the walk, not a first import.
* *config-derived* values: the :class:`~megaforge.specs.EngineSpec`, its fields (the ``rollout`` and
  ``model`` sections...) and their fields' values, followed by identity (None, booleans, the small
  ints and one-character strings Python shares are not followed: their identity says nothing), plus
  every value a counted return hands up. A function is *config-fed* when one of its inputs (its
  arguments and closure variables at entry, looked into one level: a container's items, an object's
  attributes or dataclass fields, a ``functools.partial``'s arguments) is config-derived.
* a *config return*: a config-fed function returning a value other than None, which is not the object
  it was given (a guard such as :func:`megaforge.specs.expect`, handing back the spec it checked, hands
  nothing new up). Counted whether the caller passes the value on or only branches on it.
* a *walk return* (the figure of point 7: config-derived values handed back up for the caller to pass
  on, the walk going down and back up): a config return of a function that is not a *pure leaf
  utility*. A pure leaf utility calls no megaforge function itself and the only config-derived
  values it receives are plain values (str, int, float, bool, None, or a list / tuple of them): a
  lookup or a conversion of one config value (``is_loopback(rollout.host)``,
  ``resolve_device(rollout.device)``, the engine-kind registry's lookup of ``rollout.engine``). A
  function given the spec or a config section is never one.

Values handed up by changing an object in place instead of returning them would escape this count;
the launch path does not do that (the only in-place changes are a ServerProcess's own state).

Before the restructuring (commit 'HTTP engine start: one downward pass...') this trace counted 24
functions, 70 calls, 65 returns, 15 config returns, 5 walk returns: the engine kind looked up twice
(:func:`~megaforge.engine_kinds.engine_kind` by build_engines, then again by the HTTP start for its
``on_device``), the API key handed up through ``engine_api_key`` (which asked ``is_loopback`` itself,
as the start did again for the weight roots), the model folder and the environment. After it: 24
functions, 66 calls, 61 returns, 10 config returns, 3 walk returns (the kind's registry entry, the model
folder, the kind's environment) in the default case, but 4 with two engines (the kind's environment
made once per server) and 4 bound beyond loopback (the ``--weight-root`` folders handed up from the
spec). Since the commit 'HTTP engine start: the servers' shared environment made once...': the environment every server shares
is made once and each server's GPUs set over it (:func:`megaforge.supervise.pin_gpus`), and the
weight-root folders come from the four config values they depend on (a leaf utility): 3 walk returns
in all four cases tested below (default, two engines, host 0.0.0.0, an API key); the default case
counts 25 functions, 71 calls, 66 returns, 10 config returns. Calls and returns grow
with the process's environment
(``supervise.child_env`` tests each variable); the config and walk returns do not. An earlier count
(29 functions, 77 calls, 72 returns) also took in the first import of the kind's module and
ServerProcess.start's own frames. ``python -m pytest -q -s tests/rollout/test_engine_launch_walk.py``
prints the walk and the figures.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import types

import pytest

import megaforge
from engine_helpers import engine_config

PACKAGE = os.path.dirname(os.path.abspath(megaforge.__file__)) + os.sep
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
PLAIN = (str, int, float, bool, type(None))
MAX_WALK_RETURNS = 3


def _inside(v):
    """``v`` and what it holds, one level down."""
    yield v
    if isinstance(v, (types.ModuleType, type)):
        return
    if isinstance(v, (list, tuple, set, frozenset)):
        yield from v
    elif isinstance(v, dict):
        yield from v.values()
    elif isinstance(v, functools.partial):
        yield v.func
        yield from v.args
        yield from v.keywords.values()
    elif dataclasses.is_dataclass(v):
        for f in dataclasses.fields(v):
            yield getattr(v, f.name, None)
    elif hasattr(v, "__dict__") and not callable(v):
        yield from list(vars(v).values())


def _followed(v) -> bool:
    """Whether ``v``'s identity tells where it came from (not a value Python shares)."""
    if v is None or isinstance(v, bool):
        return False
    if isinstance(v, int) and -5 <= v <= 256:
        return False
    return not (isinstance(v, str) and len(v) <= 1)


def _plain(v) -> bool:
    return isinstance(v, PLAIN) or (isinstance(v, (list, tuple)) and all(isinstance(x, PLAIN) for x in v))


class LaunchWalk:
    """The profile function: counts the walk from the first call of ``start`` (a function's qualified
    name) to the call of the code object ``stop`` (see the module docstring)."""

    def __init__(self, spec, start: str, stop: types.CodeType):
        self.start, self.stop = start, stop
        self.derived: dict[int, object] = {}  # id -> the object (kept alive, so ids stay unique)
        self._derive(spec, depth=3)
        self.active = self.done = False
        self.stack: list = []  # per megaforge frame: its record, None for a comprehension
        self.functions: dict[str, int] = {}
        self.calls = self.returns = 0
        self.config_returns: list[tuple[str, bool]] = []  # (function, a walk return)
        self.lines: list[str] = []

    def _derive(self, v, depth: int = 1) -> None:
        for x in _inside(v):
            if _followed(x) and id(x) not in self.derived:
                self.derived[id(x)] = x
                if depth > 1 and x is not v:
                    self._derive(x, depth - 1)

    def __call__(self, frame, event, arg):
        if self.done or event not in ("call", "return"):
            return
        code = frame.f_code
        if event == "call" and code is self.stop and self.active:
            self.done = True
            self.lines.append("  " * len([e for e in self.stack if e]) + "-> ServerProcess.start (the launch)")
            return
        if not code.co_filename.startswith(PACKAGE):
            return
        qualname = getattr(code, "co_qualname", code.co_name)  # Python 3.11+
        if not self.active:
            if event != "call" or qualname != self.start:
                return
            self.active = True
        name = os.path.relpath(code.co_filename, os.path.dirname(PACKAGE.rstrip(os.sep))) + ":" + qualname
        depth = len([e for e in self.stack if e])
        if code.co_name in COMPREHENSIONS:  # part of the function that holds it
            if event == "call":
                self.stack.append(None)
            else:
                self.stack.pop()
            return
        if event == "call":
            for e in reversed(self.stack):
                if e is not None:
                    e["calls"] = True
                    break
            inputs = list(frame.f_locals.values())
            given = [y for x in inputs for y in _inside(x) if id(y) in self.derived]
            self.stack.append({"given": {id(x) for x in inputs}, "fed": bool(given), "calls": False,
                               "plain": all(_plain(x) for x in given)})
            self.functions[name] = self.functions.get(name, 0) + 1
            self.calls += 1
            self.lines.append("  " * depth + f"-> {name}" + ("  (config-fed)" if given else ""))
            return
        e = self.stack.pop()
        self.returns += 1
        if e["fed"] and arg is not None and not (id(arg) in e["given"] and not _plain(arg)):
            walk = e["calls"] or not e["plain"]
            self.config_returns.append((name, walk))
            self._derive(arg)
            self.lines.append("  " * (depth - 1) + f"<- {name}  " + ("WALK RETURN" if walk else "config return, leaf utility")
                              + f": {type(arg).__name__}")
        if not any(self.stack):
            self.active = False

    @property
    def walk_returns(self) -> list[str]:
        return [n for n, walk in self.config_returns if walk]

    def figures(self) -> str:
        return (f"engine launch walk: {len(self.functions)} functions, {self.calls} calls, {self.returns} returns; "
                f"{len(self.config_returns)} config returns, {len(self.walk_returns)} walk returns")


class Launched(Exception):
    """The sentinel ServerProcess.start raises here."""


def trace_launch(spec) -> LaunchWalk:
    """The walk of ``build_engines(spec, None)`` up to the first ServerProcess.start."""
    from megaforge.engine_kinds import engine_kind
    from megaforge.placement import build_engines
    from megaforge.registry import import_callable
    from megaforge.rollout.http.processes import ServerProcess

    import_callable(engine_kind(spec.rollout.engine).build, "rollout engine code")  # the kind's module, imported

    def launch(self, *args, **kwargs):
        raise Launched(self)

    walk = LaunchWalk(spec, "build_engines", launch.__code__)
    saved = ServerProcess.start
    ServerProcess.start = launch
    sys.setprofile(walk)
    try:
        build_engines(spec, None)
    except Launched:
        pass
    finally:
        sys.setprofile(None)
        ServerProcess.start = saved
    assert walk.done, "build_engines returned without starting a server:\n" + "\n".join(walk.lines)
    return walk


@pytest.mark.parametrize("rollout", [{}, {"num_engines": 2}, {"host": "0.0.0.0"}, {"api_key": "k"}],
                         ids=["default", "two_engines", "beyond_loopback", "api_key"])
def test_the_config_walks_down_to_the_engine_launch_with_at_most_3_returns(tmp_path, tiny_model_dir, monkeypatch, rollout):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # one process
        monkeypatch.delenv(var, raising=False)
    from megaforge.build import RunBuilder

    walk = trace_launch(RunBuilder(engine_config(tmp_path, tiny_model_dir, **rollout)).engine_spec())
    print("\n" + "\n".join(walk.lines) + "\n" + walk.figures())
    assert len(walk.walk_returns) <= MAX_WALK_RETURNS, walk.figures() + ": " + ", ".join(walk.walk_returns)
