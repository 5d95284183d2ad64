"""The reward worker process of :mod:`megaforge.rewards.executor`: it builds the rewards, then runs
the chunks of calls it is sent, answering one result at a time. Started as ``python -c`` with its
pipes' descriptors in ``argv[1:3]``; it dies with the trainer (``PR_SET_PDEATHSIG``) and is a child
subreaper (``PR_SET_CHILD_SUBREAPER``): whatever its reward starts, double-forked and setsid'd
included, stays in its process tree, which the executor kills with it (:func:`kill_tree`).
"""
from __future__ import annotations

import importlib
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys

from megaforge.rewards.values import reward_value
from megaforge.supervise import become_subreaper, die_with_parent


def worker_entry() -> None:
    """A reward worker (``python -c ...`` started by :class:`_Worker`): build the rewards, then
    answer chunks of calls one result at a time. Its pipes' descriptors are ``argv[1:3]``."""
    inbox = mpc.Connection(int(sys.argv[1]), writable=False)
    outbox = mpc.Connection(int(sys.argv[2]), readable=False)
    # not Linux: both are no-ops, and the trainer's close() still kills the worker's process group
    die_with_parent(signal.SIGKILL)
    become_subreaper()  # orphans of its reward stay in its tree (kill_tree)
    build, specs, plugins, path, parent = pickle.loads(inbox.recv_bytes())
    if os.getppid() != parent:  # the trainer died before the line above
        os._exit(0)
    sys.path[:] = path
    try:
        for name in plugins:
            importlib.import_module(name)
        fns = [build(s) for s in specs]
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        outbox.send(("error", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
        return
    outbox.send(("ready", [batch_size(f) for f in fns]))
    while True:
        try:
            chunk = inbox.recv()
        except (EOFError, OSError):
            return
        for mode, fn, calls in chunk:
            for out in run_unit(fns[fn], mode, calls):
                outbox.send(out)


def batch_size(fn) -> int:
    """Calls a reward takes at once: its ``batch_size`` when it has ``score_batch``, else 0."""
    if not callable(getattr(fn, "score_batch", None)):
        return 0
    return max(1, int(getattr(fn, "batch_size", 1) or 1))


def _failure(e: BaseException) -> tuple[str, bool]:
    return f"{type(e).__name__}: {e}", isinstance(e, TimeoutError)


def run_unit(fn, mode: str, calls: list) -> list[tuple]:
    """The results ``(cid, value, error, timed_out)`` of one unit of a chunk, in call order.
    ``mode``: ``one`` (``fn(prompt, response, target)``), ``batch`` (``fn.score_batch`` over the
    calls) or ``group`` (one call whose response is a list: ``fn`` returns a list as long)."""
    try:
        if mode == "batch":
            values = fn.score_batch([c[1] for c in calls], [c[2] for c in calls], [c[3] for c in calls])
            if not isinstance(values, (list, tuple)) or len(values) != len(calls):
                raise ValueError(f"score_batch returned {type(values).__name__} "
                                 f"{len(values) if hasattr(values, '__len__') else ''} for {len(calls)} calls")
        elif mode == "group":
            (cid, prompt, responses, target), = calls
            got = fn(prompt, responses, target)
            if not isinstance(got, (list, tuple)) or len(got) != len(responses):
                raise ValueError(f"a group-level reward must return a list of {len(responses)} numbers (one per "
                                 f"response), got {type(got).__name__} {len(got) if hasattr(got, '__len__') else ''}")
            return [(cid, [reward_value(v) for v in got], "", False)]
        else:
            values = [fn(c[1], c[2], c[3]) for c in calls]
    except Exception as e:  # noqa: BLE001 - a user reward may raise anything
        error, late = _failure(e)
        return [(c[0], None, error, late) for c in calls]
    out = []
    for c, v in zip(calls, values):
        try:
            if isinstance(v, BaseException):
                raise v
            out.append((c[0], reward_value(v), "", False))
        except Exception as e:  # noqa: BLE001
            out.append((c[0], None, *_failure(e)))
    return out
