"""What the loop and its drivers share: the run's errors, :func:`on_main`, :func:`timed`, the driver
interface. It imports :mod:`megaforge.collective` and the error types of data and
rewards, nothing of the loop."""
from __future__ import annotations

import abc
import time
from contextlib import contextmanager

from megaforge import collective
from megaforge.data.sources import DataError
from megaforge.rewards import RewardError


#: the loop state's key under which :meth:`Driver.before_save` puts the tensors a checkpoint writes as files
TENSOR_FILES = "tensor_files"


class RunError(RuntimeError):
    pass


class RunStopped(RuntimeError):
    """SIGTERM / SIGUSR1 arrived: the run saved a checkpoint at a step boundary and stopped."""


class InputError(RunError):
    """Bad input met on the main rank (a data row, ...); every rank raises it together."""


@contextmanager
def timed(metrics: dict, key: str):
    """Adds the block's wall time in seconds to ``metrics[key]`` (also when it raises)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t


def say(msg: str) -> None:
    """A ``[megaforge]`` line on the main rank's stdout."""
    if collective.is_main():
        print(f"[megaforge] {msg}", flush=True)


def on_main(fn, share: bool = True):
    """Run ``fn()`` on the main rank and hand its result to every rank (``share=False``: the result stays
    on the main rank, the others get None). A DataError (or a reward failing on a whole step) there
    becomes an InputError on every rank (instead of leaving the other ranks waiting in a collective)."""
    out, kept = None, None
    if collective.is_main():
        try:
            out = ("ok", fn())
        except (DataError, RewardError) as e:
            out = ("error", str(e))
        if not share and out[0] == "ok":
            out, kept = ("ok", None), out[1]
    out = collective.broadcast_object(out)  # small: a status, an error message, or the shared result
    if out[0] == "error":
        raise InputError(out[1])
    return out[1] if share else kept


class Driver(abc.ABC):
    """How :meth:`megaforge.loop.Run.rl` runs its steps (:class:`megaforge.driver.sync.SyncDriver`,
    :class:`megaforge.driver.offpolicy.AsyncDriver`); every method is called on every rank."""

    @abc.abstractmethod
    def step(self, step: int, bar) -> dict:
        """RL step ``step`` (1-based): rollout, training and weight push as the driver schedules them.
        Returns the step's metrics (complete on the main rank, which logs them)."""

    @abc.abstractmethod
    def before_save(self, state: dict) -> None:
        """Before a checkpoint: put what the driver keeps into the loop ``state`` (main rank): the data
        position after the last rollout handed to a step, and what else it needs to resume exactly.
        Tensors go under ``state[TENSOR_FILES]`` as ``{file name: {name: tensor}}``: the loop takes
        them out before the state is shared and written as JSON, and writes them as files of the
        checkpoint (:func:`megaforge.checkpoint.save`)."""

    def engine_for_eval(self) -> None:
        """Main rank, between steps: make the engine free for an evaluation (it is, between two
        synchronous steps)."""

    def close(self) -> None:
        """The run is over (or failed): stop what the driver started (nothing, for a synchronous one)."""
