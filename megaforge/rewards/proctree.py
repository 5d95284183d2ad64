"""Process trees on Linux, read from ``/proc``: what a reward worker started, to kill it all."""
from __future__ import annotations

import collections
import os
import signal


def children_map() -> dict[int, list[int]]:
    """{pid: [its children]} of every process in /proc (empty where /proc cannot be read)."""
    tree: dict[int, list[int]] = collections.defaultdict(list)
    try:
        names = os.listdir("/proc")
    except OSError:
        return tree
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        tree[int(fields[1])].append(int(name))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. A stopped process forks nothing, so the tree is
    stopped (SIGSTOP) from the top, and read again, until no new process appears; then all of it is
    killed. Orphans a reward left behind are below its worker (a child subreaper), setsid or not."""
    stopped: set[int] = set()
    while True:
        tree, below, todo = children_map(), [pid], [pid]
        while todo:
            kids = tree.get(todo.pop(), [])
            below += kids
            todo += kids
        new = [p for p in below if p not in stopped]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:  # gone already
                pass
            stopped.add(p)
    for p in stopped:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
