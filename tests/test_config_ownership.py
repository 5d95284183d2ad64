"""Who takes the whole configuration tree (issue 42, point 1): an AST scan of megaforge/ (nothing is
imported) for the functions and methods that receive the root :class:`~megaforge.config.Config`.

A parameter counts as the whole tree when
- it is annotated ``Config`` (also ``Optional[Config]``, ``"Config"``, ``Config | None``), or
- it is named ``cfg`` / ``config`` and the body reads it as the root: ``cfg.<section>`` (``cfg.trainer.lr``)
  or one of the root's own keys and properties (``cfg.run_dir``, ``cfg.max_steps``), directly or through
  ``self.<attr>`` it was stored in (``self.cfg = cfg`` and ``self.cfg.rollout`` in another method), or
- it is named ``cfg`` / ``config`` and handed on whole to a function that counts (by name, to a fixed point).

The ratchet: every function found is in ALLOWED (the build step, the run's top level, the launchers'
start-up check, the tree's own checks and persistence, and the library API's entry points: they are
meant to see the tree) or in PENDING (named, per module: the ones not yet converted). A new function
taking the whole tree fails the test; so does an entry that no longer takes it (remove it: the count only
goes down).

The bound: the functions found are split into the entry points (the public functions of megaforge.api,
named in its ``__all__``: a library API given a Config by the user, as the launchers are, each a thin call
into the build step) and the internal ones (everything else, private API helpers included); at most
MAX_INTERNAL (10) internal functions may see the whole tree. ``python tests/test_config_ownership.py``
prints the count per module and the split.
"""
from __future__ import annotations

import ast
import os
import sys
from collections import Counter

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megaforge")
NAMES = ("cfg", "config")


def _root_keys() -> frozenset[str]:
    """The attributes only the root has: its section fields, own keys and properties (read from
    megaforge/config/root.py's ``class Config`` with ast, so the scan does not import the package)."""
    tree = ast.parse(open(os.path.join(ROOT, "config", "root.py"), encoding="utf-8").read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    keys = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            keys.add(n.target.id)
        elif isinstance(n, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in n.decorator_list):
            keys.add(n.name)
    # keys a section also has (cfg.seed of a data section, cfg.path...) would make a section look like
    # the root: only the root's sections and the names no section class declares count
    return frozenset(keys - {"seed", "resume"})


ROOT_KEYS = _root_keys()


def _annotated_config(arg: ast.arg) -> bool:
    if arg.annotation is None:
        return False
    text = ast.unparse(arg.annotation).replace("'", "").replace('"', "")
    parts = {p.strip() for p in text.replace("Optional[", "").replace("]", "").split("|")}
    return "Config" in parts


def _params(fn) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def _own_nodes(fn):
    """The nodes of ``fn``'s body, not those of functions / classes nested in it (they are scanned on
    their own, with their own parameters; a closure reading the outer ``cfg`` counts for the outer)."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            stack.append(child)


def _reads_root(nodes, name: str) -> bool:
    return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
               and n.attr in ROOT_KEYS for n in nodes)


def _self_root_attrs(cls: ast.ClassDef) -> set[str]:
    """``X`` where a method of ``cls`` reads ``self.X.<root key>``."""
    out = set()
    for n in ast.walk(cls):
        if (isinstance(n, ast.Attribute) and n.attr in ROOT_KEYS and isinstance(n.value, ast.Attribute)
                and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"):
            out.add(n.value.attr)
    return out


def _stored_as(nodes, name: str) -> set[str]:
    """``X`` for each ``self.X = name`` (also in a tuple assignment ``self.cfg, self.mode = cfg, mode``)."""
    out = set()
    for n in nodes:
        if not isinstance(n, ast.Assign):
            continue
        for t in n.targets:
            pairs = (zip(t.elts, n.value.elts) if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple)
                     and len(t.elts) == len(n.value.elts) else [(t, n.value)])
            for tgt, val in pairs:
                if (isinstance(tgt, ast.Attribute) and isinstance(tgt.value, ast.Name) and tgt.value.id == "self"
                        and isinstance(val, ast.Name) and val.id == name):
                    out.add(tgt.attr)
    return out


def _handed_to(nodes, name: str) -> set[str]:
    """Simple names of the functions ``name`` is passed to whole (``f(cfg)``, ``obj.f(x, cfg=cfg)``, also
    through one wrapping call: ``RunBuilder(_config(cfg))``)."""
    def whole(a) -> bool:
        return isinstance(a, ast.Name) and a.id == name

    out = set()
    for n in nodes:
        if isinstance(n, ast.Call):
            args = [*n.args, *(k.value for k in n.keywords)]
            if any(whole(a) or isinstance(a, ast.Call) and any(whole(x) for x in a.args) for a in args):
                f = n.func
                out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def scan_source(src: str, module: str) -> dict[str, tuple[bool, set[str]]]:
    """{``module:Qual.name``: (takes the whole tree for certain, names its cfg is handed to)}."""
    tree = ast.parse(src)
    found: dict[str, tuple[bool, set[str]]] = {}

    def visit(node, prefix: str, cls: ast.ClassDef | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", child)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{module}:{prefix}{child.name}"
                nodes = list(_own_nodes(child))
                sure, handed = False, set()
                self_roots = _self_root_attrs(cls) if cls is not None else set()
                for arg in _params(child):
                    if _annotated_config(arg):
                        sure = True
                    elif arg.arg in NAMES:
                        if _reads_root(nodes, arg.arg) or _stored_as(nodes, arg.arg) & self_roots:
                            sure = True
                        else:
                            handed |= _handed_to(nodes, arg.arg)
                if sure or handed:
                    found[qual] = (sure, handed)
                visit(child, f"{prefix}{child.name}.<locals>.", None)

    visit(tree, "", None)
    return found


def resolve(found: dict[str, tuple[bool, set[str]]]) -> set[str]:
    """The functions that take the whole tree: the certain ones, then (to a fixed point) those that hand
    their ``cfg`` on to a function of that name."""
    whole = {q for q, (sure, _) in found.items() if sure}
    while True:
        names = {q.rsplit(":", 1)[1].split(".")[-1] for q in whole} - {"__init__"}
        names |= {q.rsplit(".", 1)[0].split(":")[1].split(".")[-1] for q in whole if q.endswith(".__init__")}
        more = {q for q, (_, handed) in found.items() if q not in whole and handed & names}
        if not more:
            return whole
        whole |= more


def scan_package(root: str = ROOT, package: str = "megaforge") -> set[str]:
    found = {}
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                found.update(scan_source(open(path, encoding="utf-8").read(), rel.removesuffix(".__init__")))
    return resolve(found)


#: at most this many internal functions (not megaforge.api's public ones) see the whole tree (issue 42)
MAX_INTERNAL = 10
API = "megaforge.api"


def api_public() -> frozenset[str]:
    """The names in megaforge/api.py's ``__all__`` (read with ast)."""
    tree = ast.parse(open(os.path.join(ROOT, "api.py"), encoding="utf-8").read())
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            return frozenset(ast.literal_eval(n.value))
    return frozenset()


def split(names) -> tuple[set[str], set[str]]:
    """(entry points: megaforge.api's public functions, internal: the rest)."""
    public = api_public()
    entry = {q for q in names if q.split(":")[0] == API and q.split(":")[1] in public}
    return entry, set(names) - entry


#: meant to see the whole tree: the build step, the run's top level, the launchers' start-up check, the
#: config's own checks / persistence (they are about the tree itself), and the library API's entry points
ALLOWED: set[str] = {
    # the build step (megaforge.build): the one place that turns the tree into components
    'megaforge.build:RunBuilder.__init__',
    # the run's top level
    'megaforge.loop:Run.__init__', 'megaforge.loop:run_grpo', 'megaforge.loop:run_sft',
    # the library API (megaforge.api): its public functions take a Config, as the launchers do (entry points)
    'megaforge.api:run_grpo', 'megaforge.api:run_sft', 'megaforge.api:score', 'megaforge.api:load_tokenizer',
    'megaforge.api:build_engine', 'megaforge.api:build_rewards', 'megaforge.api:build_trainer',
    'megaforge.api:generate', 'megaforge.api:prompt_rows', 'megaforge.api:push_weights', 'megaforge.api:train_step',
    # the launchers' start-up checks of the tree (before any work)
    'megaforge.startup:resolve',
    # the tree itself: its cross-section checks, persistence
    'megaforge.config:save_config', 'megaforge.config.evaluation:EvalConfig.validate_with',
}

#: not yet converted (issue 42): each should take its sections or a spec of megaforge.specs
PENDING: set[str] = set()


def per_module(names) -> Counter:
    return Counter(q.split(":")[0] for q in names)


FIXTURE = '''
from megaforge.config import Config

def annotated(cfg: Config, x): return x

def maybe(c: "Optional[Config]" = None): return c

def reads_root(cfg):
    return cfg.trainer.lr

def hands_on(cfg, tok):
    return reads_root(cfg)

def a_section(cfg):
    return cfg.path, cfg.seed          # a DataConfig: not the root

def passes_a_section(cfg):
    return a_section(cfg.data)         # reads cfg.data: the root

class KeepsASection:
    def __init__(self, cfg):
        self.cfg = cfg
    def later(self):
        return self.cfg.path           # a section kept on self: not the root

class Holder:
    def __init__(self, cfg, n):
        self.cfg, self.n = cfg, n
    def later(self):
        return self.cfg.rollout.engine

class Builds:
    def __init__(self, config):
        self.x = Holder(config, 1)

def wraps(cfg):
    return Holder(checked(cfg), 2)     # handed on through a wrapping call

def outer(cfg):
    def inner(spec):
        return spec.lr
    return inner(cfg.trainer)
'''


def test_the_scan_finds_each_form_on_a_fixture():
    whole = resolve(scan_source(FIXTURE, "fx"))
    assert whole == {"fx:annotated", "fx:maybe", "fx:reads_root", "fx:hands_on", "fx:passes_a_section",
                     "fx:Holder.__init__",
                     "fx:Builds.__init__", "fx:wraps", "fx:outer"}


def test_the_scan_finds_known_whole_tree_functions_in_the_package():
    """Not vacuous on the real tree: the config's own check and the run's top level are found."""
    whole = scan_package()
    assert {"megaforge.config:save_config", "megaforge.loop:run_grpo", "megaforge.loop:Run.__init__"} <= whole


def test_only_allowed_and_pending_functions_take_the_whole_config():
    whole = scan_package()
    new = sorted(whole - ALLOWED - PENDING)
    assert not new, ("these functions take the whole Config (issue 42): give them the sections they read or a "
                     "spec of megaforge.specs, built in megaforge.build.RunBuilder:\n  " + "\n  ".join(new))
    gone = sorted((ALLOWED | PENDING) - whole)
    assert not gone, "no longer take the whole Config: remove them from ALLOWED / PENDING:\n  " + "\n  ".join(gone)
    assert not ALLOWED & PENDING


def test_at_most_ten_internal_functions_take_the_whole_config():
    """Only the launchers' way in, the build step and the run's top level see the whole tree: apart from
    megaforge.api's public functions (entry points, as the launchers), at most MAX_INTERNAL functions."""
    entry, internal = split(scan_package())
    assert entry, "megaforge.api's public functions take a Config: the split found none (is api.__all__ read?)"
    assert len(internal) <= MAX_INTERNAL, (
        f"{len(internal)} internal functions take the whole Config (at most {MAX_INTERNAL}, issue 42): give them "
        f"their sections or a spec of megaforge.specs, built in megaforge.build.RunBuilder:\n  "
        + "\n  ".join(sorted(internal)))


def test_the_split_counts_private_api_helpers_as_internal():
    entry, internal = split({"megaforge.api:run_grpo", "megaforge.api:_parts", "megaforge.loop:run_grpo",
                             "megaforge.api:Session.__init__"})
    assert entry == {"megaforge.api:run_grpo"}
    assert internal == {"megaforge.api:_parts", "megaforge.loop:run_grpo", "megaforge.api:Session.__init__"}


if __name__ == "__main__":
    whole = scan_package()
    for mod, n in sorted(per_module(whole).items(), key=lambda kv: -kv[1]):
        print(f"{n:4d} {mod}")
    print(f"{len(whole)} functions in {len(per_module(whole))} modules take the whole Config "
          f"({len(whole & ALLOWED)} allowed, {len(whole & PENDING)} pending, {len(whole - ALLOWED - PENDING)} new)")
    entry, internal = split(whole)
    print(f"  entry points (megaforge.api's public functions): {len(entry)}")
    print(f"  internal: {len(internal)} (at most {MAX_INTERNAL})")
    if "-v" in sys.argv:
        print("\n".join(sorted(whole)))
