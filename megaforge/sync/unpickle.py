"""A restricted unpickler: only allowlisted globals, as opaque tokens; no object building but through
checked builders. The allowlist of a tensor bucket is :data:`megaforge.sync.tensor_payload.TENSOR_BUCKET`.

Rules (what :class:`RestrictedUnpickler` enforces; Python's pure-Python unpickler does the parsing):

* An allowed global resolves to a :class:`Token` (its name), never to the class or function itself, so
  a payload cannot reach a real class (no attribute set on ``torch.UntypedStorage``, no method call);
  a global of the allowlist's ``values`` (torch dtypes) resolves to that value. Any other global
  raises :class:`UnpicklingRefused` naming it.
* ``REDUCE`` calls only a token's builder, which checks argument types and sizes before anything is
  called or allocated; the bytes that one payload's builders reserve are bounded (``max_bytes``).
* ``NEWOBJ`` / ``BUILD`` make and fill *records* (the allowlist's record classes, no constructor
  arguments): ``BUILD`` sets fields among the allowlist's ``record_fields`` on a record made in the same
  payload, once. ``OBJ``, ``INST``, persistent ids, extension codes, out-of-band buffers and
  ``BYTEARRAY8`` (which allocates its declared length first) are refused; container opcodes apply to
  real lists, dicts and sets only.
* Work and memory before any building are bounded: one parser executes at most ``max_ops`` opcodes
  (:data:`MAX_OPS` by default). Each opcode adds at most one object to the stack, the memo or a
  container, so a payload of 50 M one-byte ``EMPTY_LIST`` opcodes (~3 GB of lists) is refused after
  ``max_ops`` (~1 M objects, ~60 MB) instead of being built. A bucket of separate tensors needs ~46
  opcodes per tensor (1 M: ~22,000 tensors in one bucket); a flattened bucket needs a few per tensor.

Malformed payloads, refused opcodes and sizes raise :class:`PayloadError` (a ValueError) naming the reason.
"""
from __future__ import annotations

import _compat_pickle
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable


class UnpicklingRefused(ValueError):
    """A pickled payload names a global outside the allowlist; ``.global_name`` is ``module.name``."""

    def __init__(self, global_name: str):
        hint = ""
        if global_name.endswith(".rebuild_storage_fd"):
            hint = (" (CPU tensors must be shared by file name: torch.multiprocessing's 'file_system' strategy, "
                    "as megaforge.sync.wire.serialize does; file descriptors do not cross unrelated processes)")
        super().__init__(f"refused pickled global {global_name!r}: only torch tensor/storage rebuild "
                         f"functions, dtypes and plain containers may appear in serialized_named_tensors{hint}")
        self.global_name = global_name


class PayloadError(ValueError):
    """A payload that is malformed, uses a refused opcode, or declares more bytes than allowed."""


class Token:
    """An allowed global as a payload sees it: a name, never the real class or function."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)

    def __setattr__(self, key, value):
        raise PayloadError(f"cannot set attributes of the pickled global {self.name}")

    def __repr__(self) -> str:
        return f"<global {self.name}>"


@dataclass(frozen=True)
class Allowlist:
    """What a payload may build. ``builders``: global name -> ``fn(unpickler, args)`` run by REDUCE;
    ``tokens``: further names that resolve to tokens (classes passed as builder arguments);
    ``values``: names that resolve to these values; ``records``: global name -> factory of an empty
    record (NEWOBJ), whose fields BUILD may set among ``record_fields``."""

    builders: dict[str, Callable]
    tokens: frozenset = frozenset()
    values: dict[str, Any] = field(default_factory=dict)
    records: dict[str, Callable[[], Any]] = field(default_factory=dict)
    record_fields: tuple = ()


# ------------------------------------------------------------------------------------ argument checks
MAX_DIM = 1 << 62
MAX_OPS = 1 << 20  # opcodes one parser may execute (see the module docstring)


def bad(what: str, v: Any, expected: str):
    raise PayloadError(f"{what}: expected {expected}, got {type(v).__name__} {v!r:.80}")


def as_int(v, what: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    if type(v) is not int or not lo <= v <= hi:
        bad(what, v, f"an integer in [{lo}, {hi}]")
    return v


def as_ints(v, what: str) -> tuple:
    if not isinstance(v, (tuple, list)) or len(v) > 64:  # torch.Size is a tuple
        bad(what, v, "a sequence of at most 64 integers")
    return tuple(as_int(x, f"{what}[{i}]") for i, x in enumerate(v))


def as_args(args, n: tuple, what: str) -> tuple:
    if type(args) is not tuple or len(args) not in n:
        bad(f"{what} arguments", args, f"a tuple of {' or '.join(map(str, n))} values")
    return args


def as_bool(v, what: str) -> bool:
    if type(v) is not bool:
        bad(what, v, "a boolean")
    return v


def as_class(v, table: dict, what: str):
    """The entry of ``table`` that token ``v`` names."""
    if not isinstance(v, Token) or v.name not in table:
        bad(what, v, f"one of {sorted(table)}")
    return table[v.name]


# ------------------------------------------------------------------------------------- unpicklers
class OpcodeRestricted(pickle._Unpickler):
    """Python's unpickler with the object-building opcodes refused and container opcodes restricted
    to real containers; no global resolves (subclasses allow some)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, budget: list, max_ops: int = MAX_OPS):
        super().__init__(file)
        self.budget = budget  # [bytes still allowed], shared with nested parsers
        self.ops_left = max_ops
        self.max_ops = max_ops

    def count_op(self) -> None:
        """Called before every opcode: refuse the payload once it has executed ``max_ops`` of them."""
        self.ops_left -= 1
        if self.ops_left < 0:
            raise PayloadError(f"more than {self.max_ops} pickle opcodes: a tensor bucket needs far fewer (each opcode "
                               f"may add an object; refused before building them)")

    def reserve(self, nbytes: int, what: str) -> None:
        if nbytes > self.budget[0]:
            raise PayloadError(f"{what}: {nbytes} bytes exceed what is left of the payload's limit "
                               f"({self.budget[0]} bytes; server flag --max-bucket-mb)")
        self.budget[0] -= nbytes

    def find_class(self, module, name):
        raise UnpicklingRefused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise PayloadError("persistent ids are not allowed in serialized_named_tensors")

    def _refuse(self, opcode: str):
        raise PayloadError(f"pickle opcode {opcode} is not allowed in serialized_named_tensors")

    def load_reduce(self):
        self._refuse("REDUCE")

    def load_build(self):
        self._refuse("BUILD")

    def load_newobj(self):
        self._refuse("NEWOBJ")

    def load_newobj_ex(self):
        self._refuse("NEWOBJ_EX")

    def load_obj(self):
        self._refuse("OBJ")

    def load_inst(self):
        self._refuse("INST")

    def load_ext(self):
        self._refuse("EXT")

    def load_bytearray8(self):
        self._refuse("BYTEARRAY8")

    def load_next_buffer(self):
        self._refuse("NEXT_BUFFER")

    def load_append(self):
        value = self.stack.pop()
        self._target(list, "APPEND").append(value)

    def load_appends(self):
        items = self.pop_mark()
        self._target(list, "APPENDS").extend(items)

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(dict, "SETITEM")[key] = value

    def load_setitems(self):
        items = self.pop_mark()
        d = self._target(dict, "SETITEMS")
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]

    def load_additems(self):
        items = self.pop_mark()
        self._target(set, "ADDITEMS").update(items)

    def _target(self, kind: type, opcode: str):
        obj = self.stack[-1]
        if type(obj) not in ((dict, OrderedDict) if kind is dict else (kind,)):
            raise PayloadError(f"pickle opcode {opcode} on a {type(obj).__name__}, not a {kind.__name__}")
        return obj

    def load(self):
        try:
            return super().load()
        except (UnpicklingRefused, PayloadError):
            raise
        except (pickle.UnpicklingError, EOFError, IndexError, KeyError, TypeError, ValueError, AttributeError,
                RuntimeError, struct.error, UnicodeDecodeError, OverflowError) as e:
            raise PayloadError(f"malformed pickle: {type(e).__name__}: {e}") from None


def _dispatch_to(name: str):
    return lambda self: getattr(self, name)()  # resolved on the instance: subclasses override by name


for _op, _fn in ((pickle.REDUCE, "load_reduce"), (pickle.BUILD, "load_build"), (pickle.NEWOBJ, "load_newobj"),
                 (pickle.NEWOBJ_EX, "load_newobj_ex"), (pickle.OBJ, "load_obj"), (pickle.INST, "load_inst"),
                 (pickle.EXT1, "load_ext"), (pickle.EXT2, "load_ext"), (pickle.EXT4, "load_ext"),
                 (pickle.BYTEARRAY8, "load_bytearray8"), (pickle.NEXT_BUFFER, "load_next_buffer"),
                 (pickle.APPEND, "load_append"), (pickle.APPENDS, "load_appends"), (pickle.SETITEM, "load_setitem"),
                 (pickle.SETITEMS, "load_setitems"), (pickle.ADDITEMS, "load_additems")):
    OpcodeRestricted.dispatch[_op[0]] = _dispatch_to(_fn)


def _counted(fn):
    def op(self):
        self.count_op()
        return fn(self)
    return op


for _op, _fn in list(OpcodeRestricted.dispatch.items()):  # every opcode counted (MAX_OPS)
    OpcodeRestricted.dispatch[_op] = _counted(_fn)


def global_name(module: str, name: str) -> str:
    """``module.name``, with Python 2 names (protocol < 3 pickles) mapped as pickle.Unpickler does."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    else:
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return f"{module}.{name}"


class RestrictedUnpickler(OpcodeRestricted):
    """An unpickler that builds only what ``allow`` permits (see the module docstring)."""

    def __init__(self, file, allow: Allowlist, max_bytes: int, max_ops: int = MAX_OPS):
        super().__init__(file, [int(max_bytes)], max_ops)
        self.allow = allow
        self._records: dict[int, Any] = {}  # id -> record made in this payload, not yet BUILT
        self._keep: list = []  # keeps the records alive, so their ids stay unique

    def find_class(self, module, name):
        full = global_name(module, name)
        a = self.allow
        if full in a.values:
            return a.values[full]
        if full in a.builders or full in a.tokens or full in a.records:
            return Token(full)
        raise UnpicklingRefused(full)

    def new_record(self, obj):
        """Register ``obj`` as a record of this payload (BUILD may set its fields once)."""
        self._records[id(obj)] = obj
        self._keep.append(obj)
        return obj

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not isinstance(func, Token) or func.name not in self.allow.builders:
            raise PayloadError(f"REDUCE of {func!r}: only torch's tensor and storage rebuild functions may be called")
        self.stack[-1] = self.allow.builders[func.name](self, args)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._record_of(cls, args, {}))

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._record_of(cls, args, kwargs))

    def _record_of(self, cls, args, kwargs):
        if not isinstance(cls, Token) or cls.name not in self.allow.records or args or kwargs:
            raise PayloadError(f"NEWOBJ of {cls!r}: only metadata records (no arguments) may be built")
        return self.new_record(self.allow.records[cls.name]())

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if self._records.pop(id(inst), None) is not inst:
            raise PayloadError(f"BUILD on {type(inst).__name__}: only a metadata record made in this payload may "
                               f"get its fields, once")
        fields = self.allow.record_fields
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            bad("metadata record fields", state, f"a dict with keys among {list(fields)}")
        for k, v in state.items():
            object.__setattr__(inst, k, v)
