"""The trainer's warm-up (:meth:`megaforge.trainer.base.Trainer.warm_up`) beside the engines' start.

On the H100 (GSM8K recipe, code cfd379d) step 1 trained for 17.2 s against ~3.9 s for the steps after
it: what compiles or initialises at its first call (torch.compile'd functions, once static and once
dynamic, for the no-grad pi_old pass and the training pass; cuBLAS; attention kernels) ran inside
step 1. :class:`WarmUp` runs the warm-up while the engines start instead: on a thread when the
trainer is one process (the engine start then only waits on its servers, and no collective of the
warm-up can interleave with one of the engine start), else at once on every rank, before the engine
start. Only on CUDA: on the CPU the trainers compile nothing (megatron-core's fused functions and
megaforge's compiled log-probs are its CUDA paths), and the warm-up would only add time."""
from __future__ import annotations

import threading
import time
from typing import Optional

from megaforge import collective


class WarmUp:
    """``trainer.warm_up()`` started now (see the module doc); :meth:`wait` joins it and re-raises
    its error. ``seconds``: its duration (None when it did not run)."""

    def __init__(self, trainer):
        self.seconds: Optional[float] = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if getattr(trainer, "device", None) is None or trainer.device.type != "cuda":
            return
        if collective.world() == 1:
            self._thread = threading.Thread(target=self._run, args=(trainer,), name="megaforge-warm-up", daemon=True)
            self._thread.start()
        else:
            self._run(trainer)
            self.wait()

    def _run(self, trainer) -> None:
        t0 = time.perf_counter()
        try:
            trainer.warm_up()
        except BaseException as e:  # re-raised by wait(), in the caller's thread
            self._error = e
        self.seconds = time.perf_counter() - t0

    def wait(self) -> Optional[float]:
        """Seconds the warm-up took (None: it did not run); raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"the trainer's warm-up before step 1 failed: {type(e).__name__}: {e}") from e
        return self.seconds
