"""The loop's driver interface (issue 22, item 2): both drivers offer the same methods, the driver
modules never import the loop (no circle), and neither the loop nor a driver calls a private method
of another object (``other._name(...)``; ``self._name`` / ``cls._name`` are the object's own)."""
import ast
import glob
import inspect
import os

from megaforge.driver.common import Driver
from megaforge.driver.offpolicy import AsyncDriver
from megaforge.driver.sync import SyncDriver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOOP_MODULES = [os.path.join(ROOT, "megaforge", "loop.py")] + sorted(glob.glob(os.path.join(ROOT, "megaforge", "driver", "*.py")))


def public_methods(cls) -> set[str]:
    return {n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_both_drivers_implement_the_same_interface():
    for cls in (SyncDriver, AsyncDriver):
        assert issubclass(cls, Driver) and not inspect.isabstract(cls)
        assert public_methods(cls) == public_methods(Driver) == {"step", "before_save", "engine_for_eval", "close"}


def imported_modules(path: str) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_driver_modules_do_not_import_the_loop():
    for path in LOOP_MODULES[1:]:
        assert not {"megaforge.loop", "megaforge.loop_offpolicy"} & imported_modules(path), path


def private_calls(path: str) -> list[str]:
    """``x._name(...)`` calls in ``path`` where ``x`` is anything but ``self`` / ``cls``."""
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("_") \
                and not node.func.attr.startswith("__"):
            owner = node.func.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {ast.unparse(node.func)}")
    return out


def test_loop_and_drivers_call_no_private_method_of_another_object():
    # run_grpo / run_sft call their own module's Run's _save_rl / _save_phase: the same module, allowed
    found = [c for p in LOOP_MODULES for c in private_calls(p)
             if not (p.endswith("loop.py") and c.split()[-1] in ("run._save_rl", "run._save_phase"))]
    assert found == []
