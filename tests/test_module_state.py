"""Issue 42 point 4: no mutable module globals in the core; state belongs to objects the run owns.

An AST scan of megaforge/ finds every module-level name that a function of its module changes (a
``global`` statement; ``NAME[k] = ...`` / ``del NAME[k]``; ``NAME.append / update / add / pop /
setdefault / move_to_end / ...``) on a module-level name bound to a dict, list, set or one of their
library kinds. What it finds must be in :data:`ALLOWED`, each with the reason it is not run state:
registries filled by registration (an extension point, as verl's), caches keyed by the content they
describe (a fresh computation would give the same value to whoever asks), and one process-wide patch
flag. A run's own state in a module global fails here, naming the module, the line and the function:
at 8cb0295 (when issue 42 was filed) the scan lists cluster._WATCHDOG, placement._NODE,
rollout/agent/multiturn._FNS and rollout/http/processes._HOOKED / _LIVE / _SPAWNER beside ALLOWED.

``python tests/test_module_state.py`` prints what the scan finds.
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megaforge")
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                 "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
MUTATING_METHODS = {"append", "extend", "update", "add", "pop", "popitem", "clear", "setdefault", "insert",
                    "remove", "discard", "move_to_end", "appendleft"}

ALLOWED = {  # (module, name): why it is not run state
    ("megaforge/convert/families.py", "FAMILIES"): "registry: register_family adds a model family",
    ("megaforge/convert/layouts.py", "LAYOUTS"): "registry: register adds a checkpoint layout",
    ("megaforge/checkpoint.py", "_VERDICTS"): "cache keyed by the checkpoint's real path and every file's "
                                              "(name, size, mtime): verify()'s result while the files are unchanged",
    ("megaforge/data/sources.py", "_INDEXES"): "LRU cache keyed by every file's (path, size, mtime): a JSONL "
                                               "file's line index",
    ("megaforge/trainer/megatron/logprobs.py", "_COMPILED"): "cache of torch.compile'd kernels keyed by their "
                                                             "static arguments",
    ("megaforge/trainer/megatron/cpu_compat.py", "_APPLIED"): "process-wide: the CPU patches of megatron-core's "
                                                              "own modules are installed once per process",
}


def _mutable(value: ast.AST) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        return (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) in MUTABLE_CALLS
    return False


def module_state(path: str) -> list[tuple[str, int, str, str]]:
    """(name, line, function, how) for each change a function of module ``path`` makes to a
    module-level mutable name, and each ``global`` statement."""
    tree = ast.parse(open(path).read(), path)
    mutable = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if _mutable(value):
            mutable |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found += [(name, node.lineno, fn.name, "global statement") for name in node.names]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id in mutable
                  and node.func.attr in MUTATING_METHODS):
                found.append((node.func.value.id, node.lineno, fn.name, f".{node.func.attr}()"))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
                found += [(t.value.id, node.lineno, fn.name, "item written") for t in targets
                          if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in mutable]
    return found


def scan(package: str = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """{(module path relative to the repo, name): ["line N in FUNCTION: how", ...]} over ``package``."""
    out: dict[tuple[str, str], list[str]] = {}
    for root, _, files in os.walk(package):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(package))
                for name, line, fn, how in module_state(path):
                    out.setdefault((rel, name), []).append(f"line {line} in {fn}: {how}")
    return out


def test_no_module_global_holds_run_state():
    found = scan()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, "module-level state changed by functions (give it to an object the run owns, or add it to " \
                    "ALLOWED with the reason it is not run state):\n" + "\n".join(
                        f"  {m}: {n} ({'; '.join(v)})" for (m, n), v in sorted(new.items()))
    gone = sorted(set(ALLOWED) - set(found))
    assert not gone, f"ALLOWED names what the scan no longer finds (remove it): {gone}"


def test_the_scan_finds_each_kind_of_module_state(tmp_path):
    pkg = tmp_path / "megaforge"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "from collections import OrderedDict\n"
        "_NODE = None\n_LIVE = []\n_FNS = {}\n_SEEN = OrderedDict()\nCONST = {'a': 1}\n"
        "def place(n):\n    global _NODE\n    _NODE = n\n"
        "def spawn(p):\n    _LIVE.append(p)\n"
        "def register(k, f):\n    _FNS[k] = f\n"
        "def seen(k):\n    _SEEN.move_to_end(k)\n"
        "def read():\n    return CONST['a'] + len(_LIVE)\n"
        "class Owner:\n    def __init__(self):\n        self.live = []\n    def add(self, p):\n        self.live.append(p)\n")
    found = scan(str(pkg))
    assert sorted(found) == [("megaforge/m.py", n) for n in ("_FNS", "_LIVE", "_NODE", "_SEEN")], found
    assert found[("megaforge/m.py", "_NODE")] == ["line 8 in place: global statement"]
    assert found[("megaforge/m.py", "_LIVE")] == ["line 11 in spawn: .append()"]


if __name__ == "__main__":
    for (m, n), v in sorted(scan().items()):
        print(f"{m}: {n}: {'; '.join(v)}  [{'allowed: ' + ALLOWED[(m, n)] if (m, n) in ALLOWED else 'NOT ALLOWED'}]")
    sys.exit(0)
