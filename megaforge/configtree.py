"""Typed configuration mechanics: dataclass trees <- YAML files + dotted CLI overrides.

A config is a tree of dataclasses. Each field may carry a docstring (a string literal on the line after
it, as torchtitan does); :func:`field_docs` reads them for ``--help`` and for error messages.

Rules:
* Unknown keys (in YAML or CLI) fail with the dotted key and the nearest valid one.
* Values are checked against the annotation: ``int``, ``float`` (ints accepted), ``str``, ``bool``,
  ``Optional[X]``, ``list[X]``, ``dict``, ``Literal[...]`` and nested dataclasses. A wrong type fails
  with the key, the expected type and the value.
* CLI values are parsed as YAML scalars (``4`` -> int, ``true`` -> bool, ``null`` -> None,
  ``[a, b]`` -> list); ``--flag`` with no value means ``true``.
* A numeric field may declare its range next to it: ``lr: float = bounded(1e-6, ge=0)``
  (:func:`bounded`: ``gt`` / ``ge`` / ``lt`` / ``le``); a value outside it (each element of a list;
  null passes) fails with the key, the range and the value, and ``--help`` shows the range.
* A dataclass's ``validate()`` may raise :class:`FieldError` about one of its own fields; the error
  names the dotted key, wherever the dataclass sits in the tree.
* Extension keys: a section may also take keys that other modules declare (the typed parameters of
  registered algorithm components). Its dataclass has a dict field with
  ``metadata={"extensions": provider}``, ``provider(section_data) -> {key prefix: dataclass}``: key
  ``<prefix><name>`` of the section is field ``name`` of that dataclass, built and checked like any
  section into ``field_value[prefix]`` and written back flat by :func:`to_dict`. The field itself is
  not a key.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from typing import Any, Iterable, Literal, Optional, Union, get_args, get_origin

import yaml

from megaforge.yaml_expansion import expansion_problem


class ConfigError(ValueError):
    """A config problem; the message names the dotted key."""


class FieldError(ValueError):
    """Raised by a dataclass's ``validate()`` about its own field ``field``; :func:`build` turns it into
    a ConfigError naming the dotted key."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# ------------------------------------------------------------------------------------------ bounds
@dataclasses.dataclass(frozen=True)
class Bound:
    """The range of a numeric field: above ``lo`` (``lo_open``: strictly) and below ``hi`` (``hi_open``:
    strictly); None: unbounded on that side."""

    lo: Optional[float] = None
    lo_open: bool = False
    hi: Optional[float] = None
    hi_open: bool = False

    def holds(self, v) -> bool:
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        return lo_ok and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi))

    def text(self) -> str:
        """``> 0``, ``>= 0``, ``<= 1``, ``in [0, 1)``, ..."""
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}"


def bounded(default: Any, *, gt: Optional[float] = None, ge: Optional[float] = None, lt: Optional[float] = None,
            le: Optional[float] = None) -> Any:
    """A dataclass field with ``default`` whose value must be ``> gt`` / ``>= ge`` and ``< lt`` / ``<= le``
    (checked by :func:`build`; for a list, every element; null always passes)."""
    if gt is not None and ge is not None or lt is not None and le is not None:
        raise ValueError("bounded: give at most one lower (gt / ge) and one upper (lt / le) bound")
    bound = Bound(gt if gt is not None else ge, gt is not None, lt if lt is not None else le, lt is not None)
    meta = {"bound": bound}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_bounds(obj, prefix: str = "") -> None:
    """ConfigError naming the first field of dataclass ``obj`` (not its sub-sections) outside its :func:`bounded` range."""
    for f in _own_fields(type(obj)):
        bound = f.metadata.get("bound")
        if bound is None:
            continue
        value = getattr(obj, f.name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if v is not None and not bound.holds(v):
                where = f"{prefix}{f.name}" + (f"[{i}]" if i is not None else "")
                null = " (or null)" if type(None) in get_args(_hints(type(obj))[f.name]) else ""
                raise ConfigError(f"config key '{where}': must be {bound.text()}{null}, got {v!r}")


# ----------------------------------------------------------------------------------- introspection
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass and of the dataclasses it extends: {field name: doc}."""
    docs: dict[str, str] = {}
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            docs.update(_own_field_docs(c))
    return docs


def _own_field_docs(cls) -> dict[str, str]:
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(src)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _extension_field(cls) -> dataclasses.Field | None:
    return next((f for f in dataclasses.fields(cls) if "extensions" in f.metadata), None)


def extensions(cls, data: dict | None = None) -> dict[str, type]:
    """{key prefix: dataclass} of the extension keys section ``cls`` takes given its ``data`` ({}: none)."""
    f = _extension_field(cls)
    return f.metadata["extensions"](data if isinstance(data, dict) else {}) if f is not None else {}


def _extension_keys(ext: dict[str, type]) -> dict[str, tuple[str, str]]:
    """{flat key: (prefix, field name)} of extension classes ``ext``."""
    return {prefix + f.name: (prefix, f.name) for prefix, c in ext.items() for f in dataclasses.fields(c)}


def _own_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "extensions" not in f.metadata]


def _section_type(t):
    """The dataclass of a section annotation: ``t`` itself, or X of ``Optional[X]`` (a section that may
    be null, e.g. ``model.lora``: a dotted override of one of its keys creates it); else None."""
    if dataclasses.is_dataclass(t):
        return t
    if get_origin(t) in (Union, types.UnionType):
        args = [a for a in get_args(t) if a is not type(None)]
        if len(args) == 1 and len(get_args(t)) == 2 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def all_keys(cls, prefix: str = "", data: dict | None = None) -> list[str]:
    """Every valid dotted key of a dataclass tree (including section names); ``data`` (the tree's
    values) decides the extension keys, see the module doc."""
    data = data if isinstance(data, dict) else {}
    keys = []
    for f in _own_fields(cls):
        key = prefix + f.name
        keys.append(key)
        t = _section_type(_hints(cls)[f.name])
        if t is not None:
            keys.extend(all_keys(t, key + ".", data.get(f.name)))
    keys.extend(prefix + k for k in _extension_keys(extensions(cls, data)))
    return keys


#: ``(hint(key, value), scalar_hint(key, value))`` pairs of the config trees built here (megaforge.config
#: adds megaforge.config.aliases'): consulted before the nearest-key guess; each returns advice or None
KEY_HINTS: list = []


def _suggest(key: str, candidates: list[str], value: Any = None) -> str:
    """``: <advice>`` from :data:`KEY_HINTS` for unknown ``key``, else the nearest valid key."""
    for hint, _ in KEY_HINTS:
        advice = hint(key, value)
        if advice:
            return f": {advice}"
    return _nearest(key, candidates)


def _nearest(key: str, candidates: list[str]) -> str:
    # Compare both the full dotted key and its last part, so a typo in a leaf finds its sibling.
    best = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not best:
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        m = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        best = [by_leaf[m[0]]] if m else []
    return f"; did you mean '{best[0]}'?" if best else ""


# --------------------------------------------------------------------------------- type checking
def check_choices(obj, prefix: str = "") -> None:
    """Every field of the dataclass tree ``obj`` with ``metadata={"choices": fn}`` holds one of ``fn()``:
    a ``str`` key whose valid values are known once the config is read, not when the dataclass is
    written (a registry's names, e.g. ``rollout.engine``); ``--help`` shows them like a ``Literal``'s."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if "choices" in f.metadata and v not in f.metadata["choices"]():
            raise ConfigError(f"config key '{prefix}{f.name}': {choice_error(v, f.metadata['choices']())}")
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            check_choices(v, prefix + f.name + ".")


def choice_error(value: Any, valid: Iterable[str]) -> str:
    """``expected one of 'a', 'b', got 'x'; did you mean 'a'?`` (the nearest valid value, if one is near)."""
    valid = list(valid)
    near = difflib.get_close_matches(value, valid, n=1, cutoff=0.6) if isinstance(value, str) else []
    return (f"expected one of {', '.join(repr(v) for v in valid)}, got {value!r}"
            + (f"; did you mean {near[0]!r}?" if near else ""))


def _type_name(t) -> str:
    if get_origin(t) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(t))
    if get_origin(t) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(t))
    if t is type(None):
        return "null"
    if get_origin(t) is list:
        (a,) = get_args(t) or (Any,)
        return f"list of {_type_name(a)}"
    return getattr(t, "__name__", str(t))


def coerce(value: Any, t, key: str) -> Any:
    """Check ``value`` against annotation ``t``; return it (dataclass values built from dicts)."""
    origin = get_origin(t)
    if t is Any:
        return value
    if origin in (Union, types.UnionType):
        section = _section_type(t)
        if section is not None and isinstance(value, dict):  # an optional section: its own key's error
            return coerce(value, section, key)
        errors = []
        for a in get_args(t):
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"config key '{key}': expected {_type_name(t)}, got {value!r}")
    if t is type(None):
        if value is None:
            return None
        raise ConfigError(f"config key '{key}': expected null, got {value!r}")
    if origin is Literal:
        if value in get_args(t):
            return value
        word = {True: "on", False: "off"}.get(value) if isinstance(value, bool) else None
        if word in get_args(t):  # YAML 1.1 reads a bare on / off as a boolean
            return word
        raise ConfigError(f"config key '{key}': expected {_type_name(t)}, got {value!r}")
    if dataclasses.is_dataclass(t):
        if isinstance(value, t):
            return value
        if not isinstance(value, dict):
            advice = next((a for _, scalar in KEY_HINTS if (a := scalar(key, value))), "")
            raise ConfigError(f"config key '{key}': expected a mapping ({t.__name__}), got {value!r}"
                              + (f"; {advice}" if advice else ""))
        return build(t, value, prefix=key + ".")
    if origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': expected {_type_name(t)}, got {value!r}")
        (a,) = get_args(t) or (Any,)
        return [coerce(v, a, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or t is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if t is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected bool (true/false), got {value!r}")
    if t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected int, got {value!r}")
    if t is float:
        v = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                v = float(value)
            except ValueError:
                pass
        if v is None:
            raise ConfigError(f"config key '{key}': expected float, got {value!r}")
        if not math.isfinite(v):  # .inf / .nan: no key means anything by them (an lr of inf wrecks the weights)
            raise ConfigError(f"config key '{key}': expected a finite number, got {value!r}")
        return v
    if t is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}': expected str, got {value!r}")
    raise ConfigError(f"config key '{key}': unsupported annotation {t!r}")


def build(cls, data: dict | None, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict, checking keys and types."""
    data = dict(data or {})
    hints = _hints(cls)
    names = {f.name for f in _own_fields(cls)}
    ext = extensions(cls, data)
    ext_keys = _extension_keys(ext)
    for k in data:
        if k not in names and k not in ext_keys:
            valid = [prefix + n for n in sorted(names | set(ext_keys))]
            raise ConfigError(f"unknown config key '{prefix}{k}'{_suggest(prefix + k, valid, data[k])}")
    kwargs = {k: coerce(v, hints[k], prefix + k) for k, v in data.items() if k in names}
    ext_field = _extension_field(cls)
    if ext_field is not None:
        parts: dict[str, dict] = {p: {} for p in ext}
        for k, (p, name) in ext_keys.items():
            if k in data:
                parts[p][name] = data[k]
        kwargs[ext_field.name] = {p: build(c, parts[p], prefix + p) for p, c in ext.items()}
    obj = cls(**kwargs)
    check_bounds(obj, prefix)
    if not prefix:  # the whole tree is built (plug-ins its sections import have registered their names)
        check_choices(obj)
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except FieldError as e:
            raise ConfigError(f"config key '{prefix}{e.field}': {e}") from None
    return obj


def to_dict(obj) -> Any:
    """A dataclass tree as plain dicts/lists (YAML- and JSON-ready)."""
    if dataclasses.is_dataclass(obj):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in _own_fields(obj)}
        ext_field = _extension_field(obj)
        if ext_field is not None:  # extension keys written back flat
            out.update({p + k: v for p, ext in getattr(obj, ext_field.name).items() for k, v in to_dict(ext).items()})
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def check_expansion(tree: Any, where: str) -> None:
    """ConfigError naming ``where`` when YAML ``tree`` refers to itself or expands past
    :data:`megaforge.yaml_expansion.MAX_YAML_VALUES` values (:func:`megaforge.yaml_expansion.expansion_problem`)."""
    problem = expansion_problem(tree)
    if problem:
        raise ConfigError(f"{where}: {problem}")


# ------------------------------------------------------------------------------------- overrides
def parse_cli(argv: list[str]) -> tuple[str | None, dict[str, Any]]:
    """``--config FILE`` and ``--a.b VALUE`` / ``--a.b=VALUE`` / ``--flag`` -> (config path, {key: value})."""
    path = None
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: use --key value, --key=value or --config FILE")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                raw = argv[i + 1]
                i += 1
            else:
                raw = "true"
        i += 1
        if key == "config":
            path = raw
            continue
        key = key.replace("-", "_")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        check_expansion(value, f"--{key}")
        overrides[key] = value
    return path, overrides


def flag_value(argv: list[str], i: int, name: str, eq: str, val: str, is_bool: bool,
               error: type[Exception] = ConfigError) -> tuple[Any, int]:
    """The value of launcher flag ``--name`` found at ``argv[i]`` (``eq``/``val``: the partition of
    ``--name=value``), and the index of the last token it used. A bool flag stands alone or takes a
    following ``true`` / ``false``; any other flag needs a value (``--name=v`` or ``--name v``,
    where ``v`` does not start with ``--``), else ``error`` is raised naming the flag."""
    if is_bool:
        if not eq and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false"):
            val, i = argv[i + 1], i + 1
        return (val or "true").lower() == "true", i
    if not eq:
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            raise error(f"--{name} needs a value")
        val, i = argv[i + 1], i + 1
    return val, i


def set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def check_keys(cls, overrides: dict[str, Any], tree: dict | None = None) -> None:
    """Every key of ``overrides`` is one of ``cls`` (with the extension keys that ``tree`` selects)."""
    valid = all_keys(cls, data=tree)
    for k in overrides:
        if k not in valid:
            raise ConfigError(f"unknown config key '{k}'{_suggest(k, valid, overrides[k])}")


def load(cls, argv: list[str], prepare=None):
    """Build ``cls`` from ``--config FILE`` (YAML) plus dotted CLI overrides; ``prepare(tree, path)``
    may adjust the file's tree before the overrides apply (megaforge.config.paths)."""
    path, overrides = parse_cli(argv)
    tree: dict = {}
    if path:
        try:
            with open(path, "rb") as f:
                tree = yaml.safe_load(f.read().decode("utf-8")) or {}  # YAML is UTF-8: decoded whole
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: no such file") from None
        except UnicodeDecodeError as e:  # the offset is the file's byte offset (decoded whole, above)
            raise ConfigError(f"--config {path}: not valid UTF-8 ({e.reason} at byte offset {e.start}); "
                              f"save the file as UTF-8") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"--config {path}: the top level must be a mapping")
        check_expansion(tree, f"--config {path}")
        if prepare is not None:
            prepare(tree, path)
    for k, v in overrides.items():
        set_dotted(tree, k, v)
    check_keys(cls, overrides, tree)
    return build(cls, tree)


def help_text(cls, prefix: str = "") -> str:
    """One line per key: ``key (type, default): doc``."""
    lines = []
    docs = field_docs(cls)
    hints = _hints(cls)
    for f in _own_fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            lines.append(f"{prefix}{f.name}:  {docs.get(f.name, '')}")
            lines.append(help_text(t, prefix + f.name + "."))
            continue
        lines.append(_help_line(prefix + f.name, t, f, docs.get(f.name, "")))
        section = _section_type(t)
        if section is not None:  # an optional section (default null): its keys, set one to enable it
            lines.append(help_text(section, prefix + f.name + "."))
    for p, c in extensions(cls).items():
        c_docs, c_hints = field_docs(c), _hints(c)
        lines.extend(_help_line(prefix + p + f.name, c_hints[f.name], f, c_docs.get(f.name, "")) for f in dataclasses.fields(c))
    return "\n".join(lines)


def _help_line(key: str, t, f: dataclasses.Field, doc: str) -> str:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
    else:
        default = "required"
    bound = f", {f.metadata['bound'].text()}" if "bound" in f.metadata else ""
    kind = ("one of " + ", ".join(repr(c) for c in f.metadata["choices"]())) if "choices" in f.metadata else _type_name(t)
    return f"  {key} ({kind}, default {default!r}{bound}): {doc}"
