"""The RL loop beyond one synchronous step: ``loop.mode: off_policy`` (rollout of step N+1 overlaps
training of step N), ``loop.partial_rollouts`` and weight pushes every ``sync.interval`` steps.

:func:`build_driver` returns an :class:`AsyncDriver` when any of those is configured; ``Run.rl`` then
calls :meth:`AsyncDriver.step` instead of ``Run.rl_step``. Rollouts are still ``Run._rollout`` (DAPO
dynamic sampling, rewards, metrics) and training is ``Run._train_batch``.

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
(waited for) and saved with the checkpoint (tokens, rollout logprobs, versions, rewards, metrics), as
is the partial-rollout pool; the data position saved is the one after that rollout. A resumed run
trains exactly that batch next and keeps the saved push schedule, so it reproduces the uninterrupted
run (tests/loop/test_offpolicy_loop.py, with partial rollouts in flight) whenever the engine's weights
at the checkpoint were the trainer's, i.e. when the checkpoint step is a multiple of sync.interval
(always for interval 1; with stale_policy correct also when no forced push is pending). Otherwise the
resumed engine starts from the trainer's newer weights, which the run logs.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Optional

import torch

from megaforge import dist
from megaforge.types import TrainBatch

_FIELDS = TrainBatch._TENSOR_FIELDS


def build_driver(run) -> Optional["AsyncDriver"]:
    cfg = run.cfg
    if cfg.loop.mode == "off_policy" or cfg.loop.partial_rollouts or cfg.sync.interval > 1:
        return AsyncDriver(run)
    return None


def batch_to_state(batch: TrainBatch) -> dict:
    """A TrainBatch as plain JSON (exact: float32 values survive the round trip through doubles)."""
    return {name: {"dtype": str(getattr(batch, name).dtype).removeprefix("torch."), "data": getattr(batch, name).tolist()}
            for name in _FIELDS if getattr(batch, name) is not None}


def batch_from_state(st: dict) -> TrainBatch:
    from megaforge.data.batch import set_denominators

    kw = {name: torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])) for name, v in st.items()}
    return set_denominators(TrainBatch(**kw))


class AsyncDriver:
    """Runs RL steps with overlap / partial rollouts / a sync interval (see the module docstring)."""

    def __init__(self, run):
        from megaforge.rollout.manager import sampling_params

        self.run, self.cfg = run, run.cfg
        cfg = self.cfg
        self.overlap = cfg.loop.mode == "off_policy"
        self.K, self.M, self.policy = cfg.loop.max_staleness, cfg.sync.interval, cfg.loop.stale_policy
        self.updates = cfg.trainer.mini_batches * cfg.trainer.epochs
        self.main = dist.is_main()
        self.partial = None
        if cfg.loop.partial_rollouts and self.main:
            from megaforge.rollout.partial import PartialPool

            self.partial = PartialPool(run.engine, run.data, run.tokenizer, cfg, run._score,
                                       sampling_params(cfg, run.stop_ids))
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="megaforge-rollout") if self.overlap and self.main else None
        self.inflight: Optional[cf.Future] = None  # main rank: the next step's rollout
        self.ready: Optional[dict] = None  # main rank: a rollout drained or restored, not trained yet
        self.engine_version = run.trainer.version  # every rank: rl() pushed the trainer's weights
        self._data_pos = run.state.get("data")  # data position after the last rollout handed to a step
        st = run.state.get("offpolicy") or {}
        if self.main and st.get("next"):
            self.ready = {"batch": batch_from_state(st["next"]["batch"]), "metrics": st["next"]["metrics"],
                          "data_after": run.state.get("data")}
        if self.partial is not None and st.get("pool"):
            self.partial.load_state_dict(st["pool"])
        saved_engine = st.get("engine_version")
        if saved_engine is not None:
            pushes_next = run.state["rl_step"] % self.M == 0  # the uninterrupted run pushes before its next rollout
            if saved_engine != self.engine_version and not pushes_next and self.main:
                print(f"[megaforge] resume: the engine served weight version {saved_engine} at the checkpoint; it now "
                      f"starts from the trainer's {self.engine_version} (rollouts differ from an uninterrupted run)",
                      flush=True)
            self.engine_version = int(saved_engine)  # the push schedule continues as in the uninterrupted run

    # ------------------------------------------------------------------------------------ rollouts
    def _produce(self, step: int, train_version: int, bar) -> dict:
        """Main rank (rollout thread or main thread): the rollout of ``step`` as a TrainBatch."""
        run = self.run
        m: dict = {}
        data_before = run.data.state_dict()
        pool_before = self.partial.state_dict() if self.partial is not None else None
        if self.partial is not None:
            self.partial.train_version = train_version
        try:
            batch = run._rollout(step, m, bar)
        except BaseException:
            self._data_pos = data_before  # the failed rollout's rows are read again after a resume
            if pool_before is not None:
                self.partial.load_state_dict(pool_before)
            raise
        return {"batch": batch, "metrics": m, "data_after": run.data.state_dict()}

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
        self.run._sync_weights(m)
        self.engine_version = self.run.trainer.version
        m["sync/pushed"] = 1.0
        m["sync/forced"] = m.get("sync/forced", 0.0) + float(forced)

    def _maybe_push(self, step: int, next_train_version: int, m: dict) -> None:
        """Push when due (after step ``step - 1``) or, with stale_policy correct, when the next rollout
        would otherwise be trained at staleness > K. Same decision on every rank (pushes are collective)."""
        if self.engine_version == self.run.trainer.version:
            return
        if step > 1 and (step - 1) % self.M == 0:
            self._push(m, forced=False)
        elif self.policy == "correct" and next_train_version - self.engine_version > self.K:
            self._push(m, forced=True)

    # ---------------------------------------------------------------------------------------- step
    def step(self, step: int, bar) -> dict:
        from megaforge.loop import on_main, timed

        run, cfg = self.run, self.cfg
        m: dict = {"sync/pushed": 0.0, "sync/forced": 0.0, "staleness/dropped_samples": 0.0}
        t0 = time.perf_counter()
        V = run.trainer.version
        if not self.overlap:
            self._maybe_push(step, V, m)
            if run.engine is not None:
                run.engine.resume_memory(["weights", "kv_cache", "cuda_graph"])  # released while training
        with timed(m, "time/wait_rollout"):
            got = on_main(lambda: self._collect(step, V, bar))
        batch = got["batch"]
        m.update(got["metrics"])
        trained = batch.loss_mask.sum(-1) > 0
        if bool(((V - batch.weight_versions) > self.K)[trained].any()):  # stale_policy drop (correct never gets here)
            m["staleness/dropped_samples"] = float(batch.batch_size)
            if self.engine_version != run.trainer.version:
                self._push(m, forced=True)
            with timed(m, "time/wait_rollout"):
                got = on_main(lambda: self._produce(step, V, bar))
            batch = got["batch"]
            m.update(got["metrics"])
            if self.main:
                self._data_pos = got["data_after"]
        if self.overlap:
            self._maybe_push(step, V + self.updates, m)
            if self.main and step < cfg.max_steps:
                self.inflight = self._pool.submit(self._produce, step + 1, V + self.updates, bar)
        self._staleness(step, batch, V, m)
        run._train_batch(batch, m, colocated=not self.overlap)
        m["weight_version"] = float(run.trainer.version)
        m["engine/weight_version"] = float(self.engine_version)
        m["time/step"] = time.perf_counter() - t0
        m["throughput/tokens_per_s"] = float(batch.lengths.sum()) / max(m["time/step"], 1e-9)
        m.setdefault("kl", 0.0)
        m.setdefault("time/sync", 0.0)
        return m

    def _staleness(self, step: int, batch: TrainBatch, V: int, m: dict) -> None:
        """staleness/mean and /max over the samples that have trained tokens; > K is a RunError."""
        from megaforge.loop import RunError

        trained = batch.loss_mask.sum(-1) > 0
        st = (V - batch.weight_versions)[trained].float()
        m["staleness/mean"] = float(st.mean()) if st.numel() else 0.0
        m["staleness/max"] = float(st.max()) if st.numel() else 0.0
        if m["staleness/max"] > self.K:
            raise RunError(f"internal error: step {step} would train samples at staleness {m['staleness/max']:.0f} "
                           f"> loop.max_staleness {self.K}")

    def engine_for_eval(self) -> None:
        """Main rank, between steps: make the engine free for an evaluation. The rollout in flight is
        waited for and kept for the next step (as before a checkpoint, so training is unchanged) and
        the engine's memory, released while the last step trained, is resumed. The engine keeps the
        weights it serves (``engine/weight_version``): no push out of schedule."""
        if self.inflight is not None:
            fut, self.inflight = self.inflight, None
            self.ready = fut.result()
        if self.run.engine is not None:
            self.run.engine.resume_memory(["weights", "kv_cache", "cuda_graph"])

    # ------------------------------------------------------------------------- checkpoints, close
    def before_save(self) -> None:
        """Every rank, before a checkpoint: drain the rollout in flight and put it, the partial
        pool and the data position after them into the run state (main rank)."""
        if not self.main:
            return
        if self.inflight is not None:
            fut, self.inflight = self.inflight, None
            try:
                self.ready = fut.result()
            except Exception:  # noqa: BLE001  (the step that collects it reports the error; here: rewind)
                self.ready = None
        st: dict = {"engine_version": self.engine_version}
        if self.ready is not None:
            st["next"] = {"batch": batch_to_state(self.ready["batch"]), "metrics": self.ready["metrics"]}
            self.run.state["data"] = self.ready["data_after"]
        else:
            self.run.state["data"] = self._data_pos
        if self.partial is not None:
            st["pool"] = self.partial.state_dict()
        self.run.state["offpolicy"] = st

    def close(self) -> None:
        """Stop the rollout thread: an unfinished rollout is aborted and its result discarded."""
        if self.inflight is not None and not self.inflight.done():
            try:
                self.run.engine.abort()
            except Exception:  # noqa: BLE001  (best effort on the way out)
                pass
        if self.inflight is not None:
            try:
                self.inflight.result(timeout=self.cfg.rollout.request_timeout_s)
            except Exception:  # noqa: BLE001
                pass
            self.inflight = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
