"""The RL loop (and the SFT loop). It calls the parts and owns nothing.

One synchronous RL step (DESIGN.md, "One RL step"):

    rows     = data.next_batch(rollout.batch_size)                       main rank
    samples  = engine.generate(rows x grpo.n_samples); rewards           main rank
    batch    = TrainBatch(samples)                                       main rank
    engine.release_memory(weights, kv_cache); trainer.onload()
    batch.advantages   = ADVANTAGES[algo.advantage](rewards, groups, ...) main rank (*)
    share    = handoff.share(batch): each DP rank its rows, as tensors    megaforge.driver.handoff
    share.ref_logprobs = trainer.compute_logprobs(share, "ref")         when a reference is used
    metrics  = trainer.train_step(share)                                 scalars reduced over ranks
    trainer.offload(state); engine.resume_memory(weights)               weights stay on the device
    engine.update_weights(trainer.iter_hf_buckets(sync.bucket_mb))       every rank iterates
    trainer.offload(weights); engine.resume_memory(kv_cache, cuda_graph)
    log metrics; checkpoint / HF export when due

(*) when the advantages read per-token trainer results (``algo.kl_in_reward``, the critic): after the
log-probs / values, by every rank on its own share (batch-wide statistics all-reduced).

``Run.driver`` runs the steps: :class:`~megaforge.driver.sync.SyncDriver` (the step above) or, for
``loop.mode: off_policy`` (rollout of step N+1 overlapping training of step N), partial rollouts and
``sync.interval > 1``, :class:`~megaforge.driver.offpolicy.AsyncDriver`; both are made of the step
primitives of :mod:`megaforge.driver.steps`. Multi-turn rollouts come in through ``rollout.generate_fn``.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import torch

from megaforge import checkpoint, collective, configtree, handoff_source, resume, startup
from megaforge.build import RunBuilder
from megaforge.cluster import Job, init_distributed
from megaforge.config import Config, save_config
from megaforge.configtree import ConfigError
from megaforge.data.batch import sft_batch
from megaforge.driver.common import TENSOR_FILES, Driver, InputError, RunError, RunStopped, on_main, say
from megaforge.driver.handoff import BatchHandOff
from megaforge.driver.steps import no_signal_warning
from megaforge.handoff_source import is_run_source
from megaforge.hf import load_tokenizer, resolve_device
from megaforge.metrics import Progress, set_aside_bad_rows
from megaforge.rollout import check_context
from megaforge.rollout.manager import stop_token_ids
from megaforge.rundir import RunDirError, claim
from megaforge.trainer.base import NonFiniteWeights
from megaforge.trainer.warm_up import WarmUp

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Run:
    """Everything one run needs; :meth:`rl` and :meth:`sft` are the two loops."""

    def __init__(self, cfg: Config, mode: str = "grpo", job: Optional[Job] = None):
        self.cfg, self.mode = cfg, mode
        self.build = RunBuilder(cfg)  # the components, each from its own sections (megaforge.build)
        self.job = job if job is not None else Job()  # rank watchdog, node engines: the launcher's, else this run's
        self.run_dir = cfg.run_dir
        startup.resolve(cfg, mode)  # bad names fail here, before the run directory and any SFT
        init_distributed(cfg.launch, resolve_device(cfg.trainer.device).type, self.job)  # timeout, rank watchdog
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.seed)
        if mode == "grpo" and cfg.max_steps > 0:
            self.build.preflight()  # e.g. rollout.engine sglang without sglang installed: fail before SFT
        self._prepare_run_dir()
        self._model_from_run()
        self.tokenizer = load_tokenizer(cfg.model)
        self.eval_sets, self.held_out = [], frozenset()  # eval.sets (main rank) and the prompts they hold out
        if mode == "grpo" and cfg.eval.sets:
            loaded = on_main(lambda: self.build.eval_sets(self.tokenizer), share=False)
            self.eval_sets, self.held_out = loaded or ([], frozenset())
        self.trainer = self.build.trainer(self.tokenizer)
        self.state = {"sft_step": 0, "rl_step": 0, "data": None, "sft_data": None, "skipped_steps": 0,
                      "skipped_updates": 0}
        self.resumed_from = None
        if cfg.resume:
            self._resume()
        self.engine = None
        self.driver: Driver | None = None  # start_rl's
        self._stop_signal = 0
        self._install_stop_handlers()

    def close(self) -> None:
        """The run is over: release the run directory (megaforge.rundir)."""
        if getattr(self, "_lock", None) is not None:
            self._lock.release()
            self._lock = None

    # ------------------------------------------------------------------------ graceful stop
    def _install_stop_handlers(self) -> None:
        """SIGTERM / SIGUSR1 (preemption, SLURM's pre-time-limit signal) finish the current step,
        write a checkpoint and stop; ``--resume`` continues exactly there."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self._stop_signal = signum

        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)

    def _stop_requested(self) -> bool:
        """True on every rank when any rank received a stop signal."""
        flag = torch.tensor([float(self._stop_signal)])
        return bool(collective.all_reduce_sum(flag).item() > 0)

    def _stop(self, phase: str, step: int) -> None:
        name = signal.Signals(self._stop_signal).name if self._stop_signal else "a stop signal"
        raise RunStopped(f"{name} received: stopped after {phase} step {step} with a checkpoint; "
                         f"continue with --resume")

    # ---------------------------------------------------------------------------------- set-up
    def _prepare_run_dir(self) -> None:
        """Main rank: lock the run directory for the run's life, then set it up (megaforge.rundir)."""
        err, self._lock = None, None
        if collective.is_main():
            refused = []

            def write_config(path: str) -> None:  # a --resume compares first (megaforge.resume)
                why = (resume.check_config(path, configtree.to_dict(self.cfg), self.cfg.resume_allow_changes, say)
                       if self.cfg.resume else None)
                if why:
                    refused.append(why)
                else:
                    save_config(self.cfg, path)
            try:
                self._lock = claim(self.run_dir, self.cfg.resume, write_config)
            except RunDirError as e:
                err = str(e)
            if refused:
                self.close()
                err = refused[0]
            elif self._lock is not None and self.cfg.resume:  # before anything heavy is loaded
                for name in ("sft_metrics.jsonl", "metrics.jsonl"):
                    for line in set_aside_bad_rows(os.path.join(self.run_dir, name)):
                        say(line)
        err = collective.broadcast_object(err)
        if err:
            raise RunError(err)

    def _model_from_run(self) -> None:
        """``model.path`` naming a megaforge run folder or checkpoint (e.g. SFT -> GRPO): the main rank
        writes its policy as an HF folder ``<run dir>/source_model`` (megaforge.handoff_source), which
        every rank then loads as ``model.path`` (config.yaml keeps the path as given)."""
        src = self.cfg.model.path
        if not is_run_source(src):
            return
        out, err = os.path.abspath(os.path.join(self.run_dir, "source_model")), None
        if collective.is_main():
            try:
                ckpt = handoff_source.export(src, out, "model.path", log=say)
                say(f"model.path {src}: the policy of {ckpt} written as {out}")
            except ConfigError as e:
                err = str(e)
        err = collective.broadcast_object(err)
        if err:
            raise RunError(err)
        self.cfg.model.path = out
        c = self.cfg
        check_context(c.model, c.data, c.rollout, c.eval)  # the source's context, now that it is readable

    def _resume(self) -> None:
        path, t0 = None, time.perf_counter()
        if collective.is_main():
            path = checkpoint.latest_valid(os.path.join(self.run_dir, "checkpoints"))  # checksums every file
        path = collective.broadcast_object(path)
        if path is None:
            say(f"--resume: no complete checkpoint in {self.run_dir}/checkpoints; starting from the beginning")
            return
        t1 = time.perf_counter()
        self.state = checkpoint.load(path, self.trainer)
        self.resumed_from = path
        say(f"resumed from {path} (sft step {self.state['sft_step']}, rl step {self.state['rl_step']}; "
            f"verified in {t1 - t0:.1f} s, loaded in {time.perf_counter() - t1:.1f} s)")
        self._schedule_from_config()

    def _schedule_from_config(self) -> None:
        """The checkpoint's learning-rate schedule (of the phase it stopped in) takes the peak, minimum,
        warm-up and shape of the configuration: they differ only where resume_allow_changes let them
        (megaforge.resume); its length and position stay the checkpoint's."""
        s, c = self.trainer.sched, self.cfg
        if not s or not (self.state["rl_step"] > 0 or 0 < self.state["sft_step"] < c.sft.max_steps):
            return  # a fresh schedule starts with the next phase (reset_optimizer)
        t = c.trainer
        new = (dict(peak=t.lr, min_lr=t.min_lr, warmup=t.warmup_steps, schedule=t.lr_schedule) if self.state["rl_step"]
               else dict(peak=c.sft.lr, min_lr=0.0, warmup=c.sft.warmup_steps, schedule="constant"))
        changed = [f"{k} {s.get(k)} -> {v}" for k, v in new.items() if s.get(k) != v]
        if changed:
            s.update(new)
            say(f"--resume: the checkpoint's learning-rate schedule takes the config's {', '.join(changed)}")

    def _build_engine(self):
        return self.build.engines(self.tokenizer, self.job)  # rank 0's engine; node leaders start their node's servers

    def _save(self, step: int, phase: str = "rl", tensors: Optional[dict] = None) -> None:
        """A checkpoint (with ``tensors``: main rank, ``{file name: {name: tensor}}`` written beside the
        loop state); pruning never deletes the one this run resumed from. Non-finite weights
        and failed writes (a full disk) stop the run naming the tensors / the path and the cause."""
        t0 = time.perf_counter()
        try:
            path = checkpoint.save(os.path.join(self.run_dir, "checkpoints"), step, self.trainer, self.state,
                                   self.cfg.checkpoint.keep_last_n, phase, protect=[self.resumed_from],
                                   tensor_files=tensors)
        except (NonFiniteWeights, checkpoint.CheckpointWriteError) as e:
            raise RunError(f"{phase.upper()} step {step}: {e}") from None
        say(f"checkpoint written: {path} in {time.perf_counter() - t0:.1f} s")

    # ------------------------------------------------------------------------------------ SFT
    def sft(self) -> None:
        cfg = self.cfg
        total = cfg.sft.max_steps
        if self.state["sft_step"] >= total:
            return
        source = self.build.sft_prompts(self.tokenizer, self.held_out) if collective.is_main() else None
        if source is not None and self.state.get("sft_data"):
            source.load_state_dict(self.state["sft_data"])
        if self.state["sft_step"] == 0:  # a resumed SFT keeps the optimizer state it saved
            self.trainer.reset_optimizer(cfg.sft.lr, total, cfg.sft.warmup_steps, "constant")
        logger = self.build.metrics_logger(self.run_dir, "sft_metrics.jsonl",
                                           resume_step=self.state["sft_step"] if self.resumed_from else None,
                                           tb_subdir="tensorboard/sft") if collective.is_main() else None
        bar = Progress(total, self.state["sft_step"], "sft", cfg.metrics.progress and collective.is_main())
        eos = self.tokenizer.eos_token_id
        handoff = BatchHandOff(*self.trainer.data_parallel(), cfg.trainer.mini_batches)
        while self.state["sft_step"] < total:
            t0 = time.perf_counter()
            try:
                batch = on_main(lambda: sft_batch(source.next_batch(cfg.sft.batch_size), eos,
                                                  self.tokenizer.pad_token_id, cfg.sft.max_len), share=False)
            except InputError as e:
                self._save_phase()
                raise InputError(f"{e}\nSFT step {self.state['sft_step']} is checkpointed: fix the input and "
                                 f"continue with --resume") from None
            share = handoff.share(batch)  # each data-parallel rank its rows, as tensors
            m = self.trainer.sft_step(share)
            self.state["sft_step"] += 1
            m["time/step"] = time.perf_counter() - t0
            m["tokens"] = float(share.num_tokens)  # the whole batch's
            if source is not None:
                self.state["sft_data"] = source.state_dict()
                logger.log(self.state["sft_step"], m)
            bar.update(m, keys=("loss", "time/step"))
            stop = self._stop_requested()
            if stop or (cfg.checkpoint.interval and self.state["sft_step"] % cfg.checkpoint.interval == 0):
                self._save_phase()
            if stop:
                bar.close()
                if logger is not None:
                    logger.close()
                self._stop("SFT", self.state["sft_step"])
        bar.close()
        if logger is not None:
            logger.close()
            say(f"SFT done: {total} steps, last loss {m['loss']:.4f}")

    def _save_phase(self) -> None:
        """An SFT checkpoint (``sft_step_N``; ordered before every RL checkpoint)."""
        self.state = collective.broadcast_object(self.state)
        self._save(self.state["sft_step"], "sft")

    # ------------------------------------------------------------------------------------- RL
    def start_rl(self) -> None:
        """Everything before the first RL step: the offload's host buffers pinned while the engines start,
        the data and rewards, the optimizer and reference at the RL start, the engines given the
        trainer's weights, the step driver. (Benchmarks call it and then :meth:`rl_step`.)"""
        cfg = self.cfg
        self.trainer.reserve_offload()  # pins the offload's host buffers while the engines start
        warm = WarmUp(self.trainer)  # step 1's first-call compiles too (CUDA; megaforge.trainer.warm_up)
        self.engine = self._build_engine()
        if warm.wait() is not None:
            say(f"trainer warm-up (step 1's first-call work): {warm.seconds:.1f} s")
        self.data = self.build.prompts(self.tokenizer, self.held_out) if collective.is_main() else None
        if self.data is not None and self.state.get("data"):
            self.data.load_state_dict(self.state["data"])
        self.rewards = self.build.rewards() if collective.is_main() else None
        if self.state["rl_step"] == 0:
            self.build.start_rl_trainer(self.trainer)
        if self.cfg.critic_enabled and self.trainer.critic is None:
            self.trainer.init_critic()  # a copy of the policy as it starts RL (after SFT)
        self.stop_ids = stop_token_ids(self.tokenizer, cfg.model.path) if collective.is_main() else []
        self.eval_settings = self.build.eval_settings()
        self.evaluator = None
        if collective.is_main():
            self.evaluator = self.build.evaluator(self.eval_settings, self.eval_sets, self.tokenizer, self.rewards,
                                                  self.stop_ids, os.path.join(self.run_dir, "eval"))
        self.start_driver()

    def start_driver(self) -> None:
        """The step primitives over the run's trainer, engine, data and rewards; the engine given the
        trainer's weights (after SFT or resume); the driver of the steps (``Run.driver``)."""
        self.parts = self.build.step_parts(self.trainer, self.engine, self.data, self.rewards, self.tokenizer,
                                           self.stop_ids)
        self.parts.push({})
        self.driver = self.build.driver(self.parts, self.state, self.resumed_from)

    def rl_step(self, step: int, bar: Progress) -> dict:
        """RL step ``step`` through the run's driver (benchmarks call it after :meth:`start_rl`)."""
        return self.driver.step(step, bar)

    def rl(self) -> None:
        cfg = self.cfg
        logger = bar = None
        bad = quiet = 0  # consecutive steps: without an applied update; with every advantage 0
        try:
            self.start_rl()
            # a run resumed before its first RL step redoes the step-0 evaluation: its old row goes
            resume_step = (self.state["rl_step"] or -1) if self.resumed_from else None
            logger = self.build.metrics_logger(self.run_dir, resume_step=resume_step) if collective.is_main() else None
            bar = Progress(cfg.max_steps, self.state["rl_step"], "grpo", cfg.metrics.progress and collective.is_main())
            if self.state["rl_step"] == 0:
                before = self._evaluate(0)  # eval.before_train: the starting policy, logged as step 0
                if before is None:  # a stop signal during it: the resumed run (at RL step 0) evaluates again
                    self._save_rl()
                    self._stop("RL", 0)
                if before and logger is not None:
                    logger.log(0, before)
            self._evaluate_pending(logger)
            while self.state["rl_step"] < cfg.max_steps:
                step = self.state["rl_step"] + 1
                try:
                    m = self.driver.step(step, bar)
                except InputError as e:  # met before the trainer changed: the last step's state is whole
                    self._save_rl()
                    raise InputError(f"{e}\nRL step {step - 1} is checkpointed: fix the input and continue "
                                     f"with --resume") from None
                bad = bad + 1 if self._count_skips(m) else 0
                quiet = quiet + 1 if m.get("advantages/nonzero_frac") == 0 else 0
                if quiet and quiet == cfg.metrics.warn_no_signal_steps and collective.is_main():
                    bar.write_err(no_signal_warning(self.parts.settings, cfg.sft.max_steps, quiet, step, m))
                self.state["rl_step"] = step
                # a stop signal (preemption: its grace period is short) defers the step's evaluation to
                # the resumed run, which evaluates the same weights first (_evaluate_pending)
                stopping = step < cfg.max_steps and self._stop_requested()
                if stopping and self.evaluates(step):
                    self.state["eval_pending"] = step
                    say(f"stop requested: the evaluation of step {step} runs first in the resumed run")
                else:
                    evaluated = self._evaluate(step)  # eval/<set>/... when due: part of the step's row
                    if evaluated is None:  # a stop signal during the evaluation: deferred the same way
                        self.state["eval_pending"], stopping = step, True
                    elif self.evaluates(step) and step < cfg.max_steps:
                        stopping = self._stop_requested()  # one during a finished evaluation: no next step
                    m.update(evaluated or {})
                if logger is not None:
                    logger.log(step, m)
                bar.update(m)
                if bad >= cfg.trainer.max_bad_steps:
                    raise RunError(f"{bad} consecutive steps had a non-finite loss or gradient in every "
                                   f"update (trainer.max_bad_steps={cfg.trainer.max_bad_steps}); stopping. "
                                   f"Metrics up to step {step} are in {self.run_dir}/metrics.jsonl")
                if stopping or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0
                                and step < cfg.max_steps):
                    self._save_rl()  # once, also when the stop falls on a checkpoint step
                if cfg.export_hf_every and step % cfg.export_hf_every == 0:
                    self.trainer.export_hf(os.path.join(self.run_dir, "hf", f"step_{step}"))
                    self.export_adapter(f"step_{step}")
                if stopping:
                    self._stop("RL", step)
            self._save_rl()
            last = self.state["rl_step"]
            if not (cfg.export_hf_every and last % cfg.export_hf_every == 0):  # else written with its HF export
                self.export_adapter(f"step_{last}")
        finally:
            self.close_rl(bar, logger)

    def close_rl(self, bar=None, logger=None) -> None:
        """Progress, metrics, driver, rewards and engines closed (whatever :meth:`start_rl` got to)."""
        if bar is not None:
            bar.close()
        if logger is not None:
            logger.close()
        if self.driver is not None:
            self.driver.close()
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if self.engine is not None:
            self.engine.shutdown()

    def evaluates(self, step: int) -> bool:
        """Whether the run evaluates after RL step ``step`` (:meth:`megaforge.specs.EvalSettings.is_due`;
        set up by :meth:`start_rl`)."""
        return self.eval_settings.is_due(step)

    def _evaluate(self, step: int, force: bool = False) -> Optional[dict]:
        """Every rank: the ``eval/...`` metrics of the engine's weights when evaluation is due after
        ``step`` (0: before training) or ``force`` (with eval sets), else {} (the metrics stay on the
        main rank). None on every rank when a stop signal reached the main rank during the evaluation:
        it was abandoned between two engine calls (megaforge.eval.runner), nothing of it written."""
        if not (self.evaluates(step) or (force and self.cfg.eval.sets)):
            return {}

        def run():
            self.driver.engine_for_eval()  # e.g. the rollout in flight drained, engine memory resumed
            return self.evaluator.run(self.engine, step, stop=lambda: bool(self._stop_signal))

        m = on_main(run, share=False)
        if collective.main_flag(m is None):
            say(f"stop requested during the evaluation of step {step}: abandoned; it runs first in the resumed run")
            return None
        m = m or {}
        if m:
            say(f"eval after step {step}: " + ", ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if k.endswith(("pass@1", "/reward/mean"))
                and "/sampled/reward" not in k))
        return m

    def _count_skips(self, m: dict) -> bool:
        """Add the step's skipped updates to the run's health counters (and to ``m``); True when the
        step applied none of its updates (every one had a non-finite loss or gradient)."""
        skipped = m.get("skipped", 0.0)
        self.state["skipped_steps"] += int(skipped > 0)
        self.state["skipped_updates"] = self.state.get("skipped_updates", 0) + int(skipped)
        m["health/skipped_steps"] = float(self.state["skipped_steps"])
        m["health/skipped_updates"] = float(self.state["skipped_updates"])
        return skipped > 0 and skipped >= m.get("updates", 1.0)

    def _evaluate_pending(self, logger) -> None:
        """Every rank: the evaluation a stop signal deferred (``state["eval_pending"]``: the stopped
        step, whose weights the checkpoint holds), merged into that step's metrics row."""
        step = self.state.pop("eval_pending", None)
        if step is None:
            return
        if step != self.state["rl_step"]:
            raise RunError(f"checkpoint state has eval_pending={step} but rl_step={self.state['rl_step']}: "
                           f"the deferred evaluation belongs to another step")
        m = self._evaluate(step, force=True)
        if m is None:  # stopped again: the checkpoint resumed from still holds this state, eval_pending included
            self._stop("RL", step)
        if m and logger is not None:
            logger.amend(step, m)

    def export_adapter(self, name: str) -> None:
        """With ``model.lora``: the PEFT adapter folder ``<run dir>/adapter/<name>/`` (else nothing)."""
        if self.cfg.model.lora is not None:
            path = os.path.join(self.run_dir, "adapter", name)
            self.trainer.export_adapter(path)
            say(f"LoRA adapter written: {path}")

    def _save_rl(self) -> None:
        if self.driver is not None:
            self.driver.before_save(self.state)  # e.g. drains the rollout in flight into the saved state
        tensors = self.state.pop(TENSOR_FILES, None)  # main rank: written as files, not shared or JSON
        self.state = collective.broadcast_object(self.state)
        self._save(self.state["rl_step"], tensors=tensors)

def run_grpo(cfg: Config, job: Optional[Job] = None) -> Run:
    run = Run(cfg, "grpo", job)
    try:
        run.sft()
        if cfg.max_steps > 0:
            run.rl()
        else:
            run._save_rl()
    finally:
        run.close()
    return run


def run_sft(cfg: Config, job: Optional[Job] = None) -> Run:
    run = Run(cfg, "sft", job)
    try:
        run.sft()
        run._save_phase()
        if cfg.export_hf_every:
            run.trainer.export_hf(os.path.join(run.run_dir, "hf", f"sft_step_{run.state['sft_step']}"))
        run.export_adapter(f"sft_step_{run.state['sft_step']}")
    finally:
        run.close()
    return run
