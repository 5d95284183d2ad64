"""The package's import graph, read from the source with `ast` (nothing is imported): no circle
between megaforge's modules, and `sync/` (weight transport) never imports `rollout/` (the engines
sit above it).

Every import statement counts, module-level or inside a function (a function-local import that
closes a circle is still a circle: it only moves the failure to run time), except those under
`if TYPE_CHECKING:`. An edge goes to the module named (``from pkg import name`` goes to
``pkg/name.py`` when that file exists, else to ``pkg/__init__.py``); a package's own ``__init__``
being run on the way is not an edge, or every package that re-exports would be a circle."""
import ast
import functools
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megaforge")


def module_files(root: str, package: str) -> dict[str, str]:
    """{dotted module name: file} of every .py under root (a package's __init__ is the package)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join([package] + rel)] = os.path.join(d, f)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def imports_of(name: str, path: str, modules: dict[str, str], package: str) -> set[str]:
    """The package modules that module `name` (file `path`) imports."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    skip = _type_checking_nodes(tree)
    is_pkg = os.path.basename(path) == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t != package and not t.startswith(package + "."):
                continue
            while t not in modules and "." in t:  # `import pkg.mod.attr` style: the longest module
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def import_graph(root: str, package: str) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {m: imports_of(m, p, modules, package) for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # recursion depth <= number of modules (~200)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def forbidden(graph: dict[str, set[str]], src: str, dst: str) -> list[str]:
    """Edges 'a -> b' from the package `src` (or below) into the package `dst` (or below)."""
    inside = lambda m, p: m == p or m.startswith(p + ".")  # noqa: E731
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if inside(a, src)
                  for b in deps if inside(b, dst))


@functools.lru_cache(maxsize=1)
def megaforge_graph() -> dict[str, set[str]]:
    return import_graph(ROOT, "megaforge")


def test_megaforge_has_no_import_circle():
    found = circles(megaforge_graph())
    assert not found, "import circles (each a set of modules importing each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_sync_imports_nothing_from_rollout():
    bad = forbidden(megaforge_graph(), "megaforge.sync", "megaforge.rollout")
    assert not bad, "sync/ sits below rollout/, yet:\n" + "\n".join(bad)


def test_process_supervision_sits_below_rollout_and_the_launchers():
    # megaforge.supervise (child processes: death signal, registry, group kill, environment) is below
    # every module that starts a process: it imports no other megaforge module, and the job-level modules
    # (cluster, slurm, launch) reach it without going through the engines' wing.
    graph = megaforge_graph()
    assert graph["megaforge.supervise"] == set()
    for mod in ("megaforge.cluster", "megaforge.slurm", "megaforge.launch"):
        assert not forbidden({mod: graph[mod]}, mod, "megaforge.rollout"), (mod, sorted(graph[mod]))
    users = {m for m, deps in graph.items() if "megaforge.supervise" in deps}
    assert {"megaforge.cluster", "megaforge.slurm", "megaforge.rollout.http.processes"} <= users


def _write(root, files):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_the_checker_finds_circles_and_forbidden_edges_it_is_shown(tmp_path):
    # A package with: a three-module circle closed by a function-local relative import, a clean
    # module, an import under TYPE_CHECKING (not an edge), and sync -> rollout through `from ... import`.
    root = str(tmp_path / "pkg")
    _write(root, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "import pkg.c\n",
        "c.py": "def f():\n    from . import a\n",
        "clean.py": "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import typed\n",
        "typed.py": "from pkg import clean\n",
        "sync/__init__.py": "",
        "sync/buffers.py": "from ..rollout.wire import pack\n",
        "rollout/__init__.py": "",
        "rollout/wire.py": "pack = 1\n",
    })
    graph = import_graph(root, "pkg")
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert graph["pkg.clean"] == set()  # the TYPE_CHECKING import is no edge, so clean <-> typed is none
    assert forbidden(graph, "pkg.sync", "pkg.rollout") == ["pkg.sync.buffers -> pkg.rollout.wire"]
    # Breaking the circle clears it: the checker reports what is there, not a fixed answer.
    _write(root, {"c.py": "def f():\n    return 1\n"})
    assert circles(import_graph(root, "pkg")) == []


@pytest.mark.parametrize("mod", ["megaforge.loop", "megaforge.config"])
def test_the_graph_sees_the_packages_known_edges(mod):
    # Guards against a checker that reads nothing: these modules import others of the package.
    assert megaforge_graph()[mod]
