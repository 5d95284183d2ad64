"""How far a config's YAML may expand once its aliases (``*name``) are followed.

A YAML file can refer to an anchor inside itself (a recursive structure) or nest aliases so that a few
lines expand to billions of values when the tree is written back ("billion laughs": nine lists of nine
aliases each are 9^9 values). :func:`expansion_problem` finds both before the tree is built or saved.
Pure; :mod:`megaforge.configtree` turns its answer into a ConfigError naming where the YAML came from."""
from __future__ import annotations

from typing import Any, Optional

#: values a config's YAML may expand to, counting every use of an alias (real configs: hundreds)
MAX_YAML_VALUES = 100_000


def _children(v):
    if isinstance(v, dict):
        return list(v.keys()) + list(v.values())
    return v if isinstance(v, list) else None


def expansion_problem(tree: Any, limit: int = MAX_YAML_VALUES) -> Optional[str]:
    """What is wrong with YAML ``tree`` (None when nothing): it refers to itself (an alias inside its own
    anchor), or it expands to more than ``limit`` values once aliases are followed. Sizes of shared lists
    and mappings are counted once each (memoised by identity), so the check itself is cheap."""
    if _children(tree) is None:
        return None
    sizes: dict[int, int] = {}
    active = {id(tree)}
    stack = [[tree, iter(_children(tree)), 1]]
    while stack:
        frame = stack[-1]
        child = next(frame[1], stack)  # the stack itself marks the end
        if child is stack:
            stack.pop()
            active.discard(id(frame[0]))
            sizes[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] += frame[2]
            if frame[2] > limit:
                return (f"the YAML expands to more than {limit} values once its aliases (*name) are followed; "
                        "write the values out or use fewer nested aliases")
            continue
        kids = _children(child)
        if kids is None:
            frame[2] += 1
        elif id(child) in active:
            return "a YAML alias refers to a value that contains it (a recursive structure)"
        elif id(child) in sizes:
            frame[2] += sizes[id(child)]
        else:
            active.add(id(child))
            stack.append([child, iter(kids), 1])
    return None
