"""The synchronous driver: one RL step is rollout -> train -> push, each waiting for the one before
(DESIGN.md "One RL step, colocated"):

    batch = on_main(parts.rollout(step))          main rank: prompts, samples, rewards, TrainBatch
    parts.train(batch, keep_weights=True)         each rank gets its share of it (megaforge.driver.handoff);
                                                  engine memory out, trainer in, optimizer step(s)
    parts.push()                                  the new weights to the engine, its KV cache back

The data position saved with a checkpoint is the one after the last step that finished."""
from __future__ import annotations

import time

from megaforge import collective, memory
from megaforge.driver.common import Driver, on_main
from megaforge.driver.steps import StepParts


class SyncDriver(Driver):
    """Runs each RL step synchronously over ``parts``; ``data_pos`` is the loop state's data position
    at the start (None: the beginning)."""

    def __init__(self, parts: StepParts, data_pos):
        self.parts = parts
        self.data_pos = data_pos  # main rank: after the last step that finished

    def step(self, step: int, bar) -> dict:
        parts = self.parts
        m: dict = {}
        t0 = time.perf_counter()
        peaks: dict = {}
        with memory.phase(peaks, "rollout"):
            batch = on_main(lambda: parts.rollout(step, m, bar), share=False)  # main rank's; None elsewhere
        m.update(peaks)
        parts.train(batch, m, keep_weights=True)  # the push right after reads the weights on the device
        parts.push(m)
        if collective.is_main():
            self.data_pos = parts.data.state_dict()
        return parts.step_metrics(m, batch, t0)

    def before_save(self, state: dict) -> None:
        if collective.is_main():
            state["data"] = self.data_pos
