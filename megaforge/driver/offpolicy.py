"""The RL loop beyond one synchronous step: ``loop.mode: off_policy`` (rollout of step N+1 overlaps
training of step N), ``loop.partial_rollouts`` and weight pushes every ``sync.interval`` steps.

:attr:`megaforge.specs.StepSettings.is_async` says when any of those is configured; ``Run.rl`` then
runs its steps through an :class:`AsyncDriver` instead of the :class:`~megaforge.driver.sync.SyncDriver`.
Both are made of the same :class:`~megaforge.driver.steps.StepParts`: rollouts are ``parts.rollout``
(DAPO dynamic sampling, the partial-rollout pool, rewards, metrics), training ``parts.train``, pushes
``parts.push``.

Off-policy step s (main rank; the rollout thread drives the engine, which runs in its own process):

    batch_s   <- rollout(s), started during step s-1 (waiting only when generation is slower)
    drop check, then push the trainer's weights when due or forced (the engine is idle here)
    start rollout(s+1) in the rollout thread, with the engine's weights (version e)
    train(batch_s)                                         overlaps rollout(s+1)

so a step takes about max(rollout, train) + push instead of rollout + train + push. Without
off_policy (sync mode with partial rollouts or sync.interval > 1) the same step runs
push-if-due -> rollout(s) -> train(s) with no thread.

Weight versions and staleness. ``V`` is the trainer's version when step s trains (optimizer updates
so far); every sample records the version ``v`` that generated it (the engine's, per completion;
per token for partial rollouts). The staleness of a trained sample is ``V - v``; with one step of
overlap it is ``u = trainer.mini_batches * trainer.epochs`` (sync: 0). Pushes are due after step t
when ``t % sync.interval == 0`` (done at the start of step t+1, when the engine is idle), so with
interval M staleness cycles through u .. M*u. ``K = loop.max_staleness`` bounds it; no token is ever
trained at staleness > K (checked every step, a violation is a RunError):

* ``stale_policy: correct``: before a rollout is started that would train at ``V_next - e > K``, the
  weights are pushed (``sync/forced``); off-policy samples are corrected by the loss's importance
  weights ``w = min(pi_theta / pi_rollout, algo.tis_cap)`` (or MIS), since pi_old is the trainer's
  current policy and pi_rollout the recorded rollout logprobs.
* ``stale_policy: drop``: pushes follow the schedule only; a batch whose staleness exceeds K is
  dropped (``staleness/dropped_samples``), the weights pushed and the batch regenerated with them.

Logged per step: ``staleness/mean``, ``staleness/max`` (over trained samples), ``staleness/dropped_samples``,
``staleness/masked_tokens``, ``sync/pushed``, ``sync/forced``, ``engine/weight_version``,
``time/wait_rollout`` (main thread blocked on the rollout) next to ``time/rollout`` (the rollout's
own time) and ``time/step`` (wall time of the step).

Checkpoints, graceful stop and exact resume: before a checkpoint the rollout in flight is *drained*
(waited for) and saved with the checkpoint: its tensors (tokens, rollout logprobs, versions, rewards)
as the file :data:`INFLIGHT_FILE`, their dtypes and shapes and its metrics in state.json; so is the
partial-rollout pool; the data position saved is the one after that rollout. A resumed run
trains exactly that batch next and keeps the saved push schedule, so it reproduces the uninterrupted
run (tests/loop/test_offpolicy_loop.py, with partial rollouts in flight) whenever the engine's weights
at the checkpoint were the trainer's, i.e. when the checkpoint step is a multiple of sync.interval
(always for interval 1; with stale_policy correct also when no forced push is pending). Otherwise the
resumed engine starts from the trainer's newer weights, which the run logs.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import time
from typing import Optional

import torch

from megaforge import collective
from megaforge.checkpoint import CheckpointError, read_tensors
from megaforge.data.batch import set_denominators
from megaforge.driver.common import TENSOR_FILES, Driver, RunError, on_main, say, timed
from megaforge.driver.steps import StepParts
from megaforge.sync.check import dtype_name
from megaforge.types import TrainBatch


#: the file of a checkpoint that holds the off-policy driver's in-flight batch (tensors)
INFLIGHT_FILE = "offpolicy_next.safetensors"


def batch_tensors(batch: TrainBatch) -> dict[str, torch.Tensor]:
    """The batch's tensor fields that are set, by name (what the checkpoint writes)."""
    return {name: t.contiguous() for name in TrainBatch.TENSOR_FIELDS if (t := getattr(batch, name)) is not None}


def tensor_record(t: torch.Tensor) -> dict:
    """{"dtype", "shape"} of ``t``, as the loop state records it."""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}


def batch_layout(batch: TrainBatch) -> dict:
    """{field: {"dtype", "shape"}} of the batch's tensors: the loop state's small JSON record of them."""
    return {name: tensor_record(t) for name, t in batch_tensors(batch).items()}


def batch_from_file(path: str, layout: dict) -> TrainBatch:
    """The in-flight batch a checkpoint wrote to ``path`` (:data:`INFLIGHT_FILE`), checked against the
    loop state's ``layout`` (:func:`batch_layout`); RunError naming the file otherwise."""
    try:
        tensors = read_tensors(path)
    except CheckpointError as e:
        raise RunError(f"resume: the off-policy batch in flight cannot be read: {e}") from None
    for name, want in layout.items():
        t = tensors.get(name)
        got = None if t is None else tensor_record(t)
        if got != want:
            raise RunError(f"resume: {path}: tensor {name!r} is {got}, state.json records {want} "
                           "(the checkpoint's files do not belong together)")
    extra = sorted(set(tensors) - set(layout))
    if extra:
        raise RunError(f"resume: {path} holds tensors {extra} that state.json does not record")
    return set_denominators(TrainBatch(**tensors))


def batch_from_json(st: dict) -> TrainBatch:
    """The in-flight batch of a checkpoint of the older format (tensors as JSON lists in state.json)."""
    kw = {name: torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])) for name, v in st.items()}
    return set_denominators(TrainBatch(**kw))


def saved_batch(next_state: dict, ckpt: Optional[str]) -> TrainBatch:
    """The in-flight batch that loop state ``next_state`` (``state["offpolicy"]["next"]``) records, read
    from checkpoint directory ``ckpt`` (its :data:`INFLIGHT_FILE`) or, for the older format, from
    the JSON itself."""
    layout = next_state["batch"]
    if all("data" in v for v in layout.values()):
        return batch_from_json(layout)
    if ckpt is None:
        raise RunError("resume: the loop state records an off-policy batch in flight but no checkpoint "
                       "directory was given to read it from")
    return batch_from_file(os.path.join(ckpt, next_state.get("file", INFLIGHT_FILE)), layout)


class AsyncDriver(Driver):
    """Runs RL steps with overlap / partial rollouts / a sync interval (see the module docstring) over
    ``parts``; ``state`` is the loop state it starts from (a resumed run's: the rollout saved in
    flight, the partial pool, the push schedule), ``ckpt`` the checkpoint directory it was read from
    (the in-flight batch's tensors are there)."""

    def __init__(self, parts: StepParts, state: dict, ckpt: Optional[str] = None):
        self.parts, self.settings = parts, parts.settings
        s = self.settings
        self.overlap = s.loop.mode == "off_policy"
        self.K, self.M, self.policy = s.loop.max_staleness, s.sync_interval, s.loop.stale_policy
        self.updates = s.updates
        self.main = collective.is_main()
        self.partial = parts.partial  # main rank, loop.partial_rollouts: the pool rollouts draw from
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="megaforge-rollout") if self.overlap and self.main else None
        self.inflight: Optional[cf.Future] = None  # main rank: the next step's rollout
        self.ready: Optional[dict] = None  # main rank: a rollout drained or restored, not trained yet
        self.engine_version = parts.trainer.version  # every rank: start_rl pushed the trainer's weights
        self._data_pos = state.get("data")  # data position after the last rollout handed to a step
        self._data_after = None  # main rank: the data position after the rollout _batch_on_main returned
        st = state.get("offpolicy") or {}
        err = None
        if self.main and st.get("next"):
            try:
                self.ready = {"batch": saved_batch(st["next"], ckpt), "metrics": st["next"]["metrics"],
                              "data_after": state.get("data")}
            except RunError as e:
                err = str(e)
        err = collective.broadcast_object(err)  # every rank stops together on an unreadable in-flight batch
        if err:
            raise RunError(err)
        if self.partial is not None and st.get("pool"):
            self.partial.load_state_dict(st["pool"])
        saved_engine = st.get("engine_version")
        if saved_engine is not None:
            pushes_next = state["rl_step"] % self.M == 0  # the uninterrupted run pushes before its next rollout
            if saved_engine != self.engine_version and not pushes_next:
                say(f"resume: the engine served weight version {saved_engine} at the checkpoint; it now "
                    f"starts from the trainer's {self.engine_version} (rollouts differ from an uninterrupted run)")
            self.engine_version = int(saved_engine)  # the push schedule continues as in the uninterrupted run

    # ------------------------------------------------------------------------------------ rollouts
    def _produce(self, step: int, train_version: int, bar) -> dict:
        """Main rank (rollout thread or main thread): the rollout of ``step`` as a TrainBatch."""
        parts = self.parts
        m: dict = {}
        data_before = parts.data.state_dict()
        pool_before = self.partial.state_dict() if self.partial is not None else None
        if self.partial is not None:
            self.partial.train_version = train_version
        try:
            batch = parts.rollout(step, m, bar)
        except BaseException:
            self._data_pos = data_before  # the failed rollout's rows are read again after a resume
            if pool_before is not None:
                self.partial.load_state_dict(pool_before)
            raise
        return {"batch": batch, "metrics": m, "data_after": parts.data.state_dict()}

    def _collect(self, step: int, train_version: int, bar) -> dict:
        if self.ready is not None:
            out, self.ready = self.ready, None
        elif self.inflight is not None:
            fut, self.inflight = self.inflight, None
            out = fut.result()
        else:
            out = self._produce(step, train_version, bar)
        self._data_pos = out["data_after"]
        return out

    # ------------------------------------------------------------------------------------- weights
    def _push(self, m: dict, forced: bool) -> None:
        self.parts.push(m)
        self.engine_version = self.parts.trainer.version
        m["sync/pushed"] = 1.0
        m["sync/forced"] = m.get("sync/forced", 0.0) + float(forced)

    def _maybe_push(self, step: int, next_train_version: int, m: dict) -> None:
        """Push when due (after step ``step - 1``) or, with stale_policy correct, when the next rollout
        would otherwise be trained at staleness > K. Same decision on every rank (pushes are collective)."""
        if self.engine_version == self.parts.trainer.version:
            return
        if step > 1 and (step - 1) % self.M == 0:
            self._push(m, forced=False)
        elif self.policy == "correct" and next_train_version - self.engine_version > self.K:
            self._push(m, forced=True)

    # ---------------------------------------------------------------------------------------- step
    def step(self, step: int, bar) -> dict:
        parts, cfg = self.parts, self.settings
        m: dict = {"sync/pushed": 0.0, "sync/forced": 0.0, "staleness/dropped_samples": 0.0}
        t0 = time.perf_counter()
        V = parts.trainer.version
        if not self.overlap:
            self._maybe_push(step, V, m)
            if parts.engine is not None:
                parts.engine.resume_memory(["weights", "kv_cache", "cuda_graph"])  # released while training
        with timed(m, "time/wait_rollout"):
            batch = self._batch_on_main(lambda: self._collect(step, V, bar), m)
        if collective.main_flag(self.main and bool((V - batch.weight_versions > self.K)[trained_rows(batch)].any())):
            # stale_policy drop (correct never gets here); the main rank decides, every rank pushes
            if self.main:
                m["staleness/dropped_samples"] = float(batch.batch_size)
            if self.engine_version != parts.trainer.version:
                self._push(m, forced=True)
            with timed(m, "time/wait_rollout"):
                batch = self._batch_on_main(lambda: self._produce(step, V, bar), m)
            if self.main:
                self._data_pos = self._data_after
        if self.overlap:
            self._maybe_push(step, V + self.updates, m)
            if self.main and step < cfg.max_steps:
                self.inflight = self._pool.submit(self._produce, step + 1, V + self.updates, bar)
        self._staleness(step, batch, V, m)
        parts.train(batch, m, colocated=not self.overlap)
        m["engine/weight_version"] = float(self.engine_version)
        m.setdefault("time/sync", 0.0)
        return parts.step_metrics(m, batch, t0)

    def _batch_on_main(self, produce, m: dict) -> Optional[TrainBatch]:
        """``produce()``'s rollout on the main rank (its metrics into ``m``, its data position kept in
        ``_data_after``); None on the other ranks (they get their shares in training)."""
        got = on_main(produce, share=False)
        if got is None:
            return None
        m.update(got["metrics"])
        self._data_after = got["data_after"]
        return got["batch"]

    def _staleness(self, step: int, batch: Optional[TrainBatch], V: int, m: dict) -> None:
        """staleness/mean and /max over the samples that have trained tokens (main rank, which holds
        the batch); > K is a RunError on every rank."""
        if self.main:
            st = (V - batch.weight_versions)[trained_rows(batch)].float()
            m["staleness/mean"] = float(st.mean()) if st.numel() else 0.0
            m["staleness/max"] = float(st.max()) if st.numel() else 0.0
        if collective.main_flag(self.main and m["staleness/max"] > self.K):
            raise RunError(f"internal error: step {step} would train samples at staleness "
                           f"{m.get('staleness/max', float('nan')):.0f} > loop.max_staleness {self.K}")

    def engine_for_eval(self) -> None:
        """Main rank, between steps: make the engine free for an evaluation. The rollout in flight is
        waited for and kept for the next step (as before a checkpoint, so training is unchanged) and
        the engine's memory, released while the last step trained, is resumed. The engine keeps the
        weights it serves (``engine/weight_version``): no push out of schedule."""
        if self.inflight is not None:
            fut, self.inflight = self.inflight, None
            self.ready = fut.result()
        if self.parts.engine is not None:
            self.parts.engine.resume_memory(["weights", "kv_cache", "cuda_graph"])

    # ------------------------------------------------------------------------- checkpoints, close
    def before_save(self, state: dict) -> None:
        """Every rank, before a checkpoint: drain the rollout in flight and put it, the partial
        pool and the data position after them into the loop ``state`` (main rank)."""
        if not self.main:
            return
        if self.inflight is not None:
            fut, self.inflight = self.inflight, None
            try:
                self.ready = fut.result()
            except Exception:  # noqa: BLE001  (the step that collects it reports the error; here: rewind)
                self.ready = None
        st: dict = {"engine_version": self.engine_version}
        if self.ready is not None:  # its tensors: a file of the checkpoint; state.json records their shapes
            st["next"] = {"batch": batch_layout(self.ready["batch"]), "file": INFLIGHT_FILE,
                          "metrics": self.ready["metrics"]}
            state[TENSOR_FILES] = {INFLIGHT_FILE: batch_tensors(self.ready["batch"])}
            state["data"] = self.ready["data_after"]
        else:
            state["data"] = self._data_pos
        if self.partial is not None:
            st["pool"] = self.partial.state_dict()
        state["offpolicy"] = st

    def close(self) -> None:
        """Stop the rollout thread: an unfinished rollout is aborted and its result discarded."""
        if self.inflight is not None and not self.inflight.done():
            try:
                self.parts.engine.abort()
            except Exception:  # noqa: BLE001  (best effort on the way out)
                pass
        if self.inflight is not None:
            try:
                self.inflight.result(timeout=self.settings.request_timeout_s)
            except Exception:  # noqa: BLE001
                pass
            self.inflight = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def trained_rows(batch: TrainBatch) -> torch.Tensor:
    """[B] bool: the rows with at least one trained token."""
    return batch.loss_mask.sum(-1) > 0
