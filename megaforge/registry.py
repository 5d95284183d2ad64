"""Named registries with clear errors, and ``package.module:callable`` plug-ins.

    LOSSES = Registry("policy loss")

    @LOSSES.register("ppo_clip")
    def ppo_clip(...): ...

    LOSSES.get("ppo_clip")             # the function
    LOSSES.get("my_pkg.losses:my_loss")  # imported from the user's own module
    LOSSES.get("ppo_clp")              # ValueError naming the registered ones

An entry may carry declarations (``@LOSSES.register("gspo", loss_agg="seq_mean_token_mean")``),
read back with ``LOSSES.declared("gspo")`` (empty for plug-ins given as ``package.module:callable``),
and its own typed parameters (``@LOSSES.register("sapo", params=SapoParams)``: a dataclass, read back
with ``LOSSES.params_classes()``; megaforge.config reads them from the config).
"""
from __future__ import annotations

import difflib
import importlib
import os
from typing import Callable, Iterable


def import_callable(path: str, what: str = "plug-in") -> Callable:
    """Import ``package.module:attr`` (attr may be dotted). Errors name the path and what failed."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{what} {path!r}: expected 'package.module:callable'")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {mod_name!r}: {e}{_moved_hint(mod_name)}") from e
    except Exception as e:  # the module itself failed (SyntaxError, an error at its import): one line naming it
        raise ValueError(f"{what} {path!r}: importing module {mod_name!r} failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {path!r}: {attr!r} is not callable")
    return obj


#: megaforge modules renamed (not only moved into a folder): old dotted path -> new one. "launch" means
#: starting a job (megaforge.launch, launchers/); the other modules that carried it say what they do.
MOVED = {
    "megaforge.launch_slurm": "megaforge.slurm",
    "megaforge.convert.launch": "megaforge.convert.ranks",
    "megaforge.rollout.http.launch": "megaforge.rollout.http.start",
    "megaforge.dist": "megaforge.collective",
}


def _moved_hint(mod_name: str) -> str:
    """For a megaforge module that is not there: its new name (:data:`MOVED`), else where a module of
    that name is now (modules moved into folders, e.g. megaforge.rollout.multiturn ->
    megaforge.rollout.agent.multiturn)."""
    if mod_name in MOVED:
        return f" (did you mean {MOVED[mod_name]!r}? the module was renamed)"
    parts = mod_name.split(".")
    if parts[0] != "megaforge" or len(parts) < 2:
        return ""
    root = os.path.dirname(os.path.abspath(__file__))
    found = sorted("megaforge." + os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")
                   for d, _, files in os.walk(root) for f in files if f == parts[-1] + ".py")
    return f" (did you mean {' or '.join(repr(m) for m in found)}?)" if found else ""


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Callable] = {}
        self._declared: dict[str, dict] = {}
        self._params: dict[str, type] = {}

    def register(self, name: str, obj: Callable | None = None, params: type | None = None, **declared):
        """Register ``obj`` under ``name`` (usable as a decorator), with optional declarations and
        ``params``, the dataclass of the entry's own parameters."""

        def deco(o):
            if name in self._items and self._items[name] is not o:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = o
            self._declared[name] = dict(declared)
            if params is not None:
                self._params[name] = params
            return o

        return deco(obj) if obj is not None else deco

    def get(self, name: str) -> Callable:
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return import_callable(name, self.kind)
        near = difflib.get_close_matches(name, list(self._items), n=1, cutoff=0.6)
        raise ValueError(
            f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._items))} "
            f"(or give 'package.module:callable')" + (f"; did you mean {near[0]!r}?" if near else "")
        )

    def declared(self, name: str) -> dict:
        """The declarations registered with ``name`` ({} for none, or for a ``package.module:callable``)."""
        return dict(self._declared.get(name, {}))

    def params_classes(self) -> dict[str, type]:
        """{entry name: its parameters' dataclass} of the entries registered with ``params``."""
        return dict(self._params)

    def names(self) -> Iterable[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
