"""The RL loop (and the SFT loop). It calls the parts and owns nothing.

One synchronous RL step (DESIGN.md, "One RL step"):

    rows     = data.next_batch(rollout.batch_size)                       main rank
    samples  = engine.generate(rows x grpo.n_samples); rewards           main rank
    batch    = TrainBatch(samples) -> broadcast to every trainer rank
    engine.release_memory(weights, kv_cache); trainer.onload()
    batch.ref_logprobs = trainer.compute_logprobs(batch, "ref")         when a reference is used
    batch.advantages   = ADVANTAGES[algo.advantage](rewards, groups, ...)
    metrics  = trainer.train_step(batch)
    trainer.offload(state); engine.resume_memory(weights)               weights stay on the device
    engine.update_weights(trainer.iter_hf_buckets(sync.bucket_mb))       every rank iterates
    trainer.offload(weights); engine.resume_memory(kv_cache, cuda_graph)
    log metrics; checkpoint / HF export when due

``loop.mode: off_policy`` (rollout of step N+1 overlapping training of step N), partial rollouts and
``sync.interval > 1`` run their steps through :mod:`megaforge.loop_offpolicy` (``Run.driver``), which
reuses ``_rollout`` and ``_train_batch``; multi-turn rollouts come in through ``rollout.generate_fn``.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from contextlib import contextmanager

import torch

from megaforge import checkpoint, dist, memory
from megaforge.algorithms import (ADVANTAGES, AdvantageInputs, first_groups, kl_reward_penalty, nonzero_variance_groups,
                                  overlong_penalty, value_targets)
from megaforge.config import Config, save_config
from megaforge.data.batch import samples_to_batch, set_denominators, sft_batch
from megaforge.data.prompts import PromptSource
from megaforge.metrics import MetricsLogger, Progress
from megaforge.rollout.manager import generate_samples, sampling_params, score, stop_token_ids


class RunError(RuntimeError):
    pass


class RunStopped(RuntimeError):
    """SIGTERM / SIGUSR1 arrived: the run saved a checkpoint at a step boundary and stopped."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextmanager
def timed(metrics: dict, key: str):
    t = time.perf_counter()
    yield
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t


class InputError(RunError):
    """Bad input met on the main rank (a data row, ...); every rank raises it together."""


def on_main(fn, share: bool = True):
    """Run ``fn()`` on the main rank and hand its result to every rank (``share=False``: the result stays
    on the main rank, the others get None). A DataError (or a reward failing on a whole step) there
    becomes an InputError on every rank (instead of leaving the other ranks waiting in a collective)."""
    from megaforge.data.sources import DataError
    from megaforge.rewards import RewardError

    out, kept = None, None
    if dist.is_main():
        try:
            out = ("ok", fn())
        except (DataError, RewardError) as e:
            out = ("error", str(e))
        if not share and out[0] == "ok":
            out, kept = ("ok", None), out[1]
    out = dist.broadcast_object(out)
    if out[0] == "error":
        raise InputError(out[1])
    return out[1] if share else kept


def _log(msg: str) -> None:
    if dist.is_main():
        print(f"[megaforge] {msg}", flush=True)


class Run:
    """Everything one run needs; :meth:`rl` and :meth:`sft` are the two loops."""

    def __init__(self, cfg: Config, mode: str = "grpo"):
        from megaforge.hf import load_tokenizer, resolve_device
        from megaforge.trainer import build_trainer

        self.cfg, self.mode = cfg, mode
        self.run_dir = cfg.run_dir
        from megaforge.cluster import init_distributed

        init_distributed(cfg, resolve_device(cfg.trainer.device).type)  # launch.dist_timeout_s, rank watchdog
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.seed)
        if mode == "grpo" and cfg.max_steps > 0:
            from megaforge.rollout import preflight

            preflight(cfg)  # e.g. rollout.engine sglang without sglang installed: fail before SFT
        self._prepare_run_dir()
        self.tokenizer = load_tokenizer(cfg.model)
        self.eval_sets, self.held_out = [], frozenset()  # eval.sets (main rank) and the prompts they hold out
        if mode == "grpo" and cfg.eval.sets:
            from megaforge.eval.sets import load_eval_sets

            loaded = on_main(lambda: load_eval_sets(cfg, self.tokenizer), share=False)
            self.eval_sets, self.held_out = loaded or ([], frozenset())
        self.trainer = build_trainer(cfg, self.tokenizer)
        self.state = {"sft_step": 0, "rl_step": 0, "data": None, "sft_data": None, "skipped_steps": 0}
        self.resumed_from = None
        if cfg.resume:
            self._resume()
        self.engine = None
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
        return bool(dist.all_reduce_sum(flag).item() > 0)

    def _stop(self, phase: str, step: int) -> None:
        name = signal.Signals(self._stop_signal).name if self._stop_signal else "a stop signal"
        raise RunStopped(f"{name} received: stopped after {phase} step {step} with a checkpoint; "
                         f"continue with --resume")

    # ---------------------------------------------------------------------------------- set-up
    def _prepare_run_dir(self) -> None:
        """Main rank: lock the run directory for the run's life, then set it up (megaforge.rundir)."""
        from megaforge.rundir import RunDirError, claim

        err, self._lock = None, None
        if dist.is_main():
            try:
                self._lock = claim(self.run_dir, self.cfg.resume, lambda path: save_config(self.cfg, path))
            except RunDirError as e:
                err = str(e)
        err = dist.broadcast_object(err)
        if err:
            raise RunError(err)

    def _resume(self) -> None:
        path = None
        if dist.is_main():
            path = checkpoint.latest_valid(os.path.join(self.run_dir, "checkpoints"))
        path = dist.broadcast_object(path)
        if path is None:
            _log(f"--resume: no complete checkpoint in {self.run_dir}/checkpoints; starting from the beginning")
            return
        self.state = checkpoint.load(path, self.trainer)
        self.resumed_from = path
        _log(f"resumed from {path} (sft step {self.state['sft_step']}, rl step {self.state['rl_step']})")

    def _build_engine(self):
        from megaforge.placement import build_engines

        return build_engines(self.cfg, self.tokenizer)  # rank 0's engine; node leaders start their node's servers

    def _save(self, step: int, phase: str = "rl") -> None:
        """A checkpoint; pruning never deletes the one this run resumed from. Non-finite weights
        and failed writes (a full disk) stop the run naming the tensors / the path and the cause."""
        from megaforge.trainer.base import NonFiniteWeights

        try:
            path = checkpoint.save(os.path.join(self.run_dir, "checkpoints"), step, self.trainer, self.state,
                                   self.cfg.checkpoint.keep_last_n, phase, protect=[self.resumed_from])
        except (NonFiniteWeights, checkpoint.CheckpointWriteError) as e:
            raise RunError(f"{phase.upper()} step {step}: {e}") from None
        _log(f"checkpoint written: {path}")

    # ------------------------------------------------------------------------------------ SFT
    def sft(self) -> None:
        cfg = self.cfg
        total = cfg.sft.max_steps
        if self.state["sft_step"] >= total:
            return
        data_cfg = cfg.sft.data or cfg.data
        source = PromptSource(data_cfg, self.tokenizer, cfg.seed, want_response=True,
                              exclude=self.held_out if data_cfg is cfg.data else frozenset()) if dist.is_main() else None
        if source is not None and self.state.get("sft_data"):
            source.load_state_dict(self.state["sft_data"])
        if self.state["sft_step"] == 0:  # a resumed SFT keeps the optimizer state it saved
            self.trainer.reset_optimizer(cfg.sft.lr, total, cfg.sft.warmup_steps, "constant")
        logger = MetricsLogger(cfg, self.run_dir, "sft_metrics.jsonl",
                               resume_step=self.state["sft_step"] if self.resumed_from else None,
                               tb_subdir="tensorboard/sft") if dist.is_main() else None
        bar = Progress(total, self.state["sft_step"], "sft", cfg.metrics.progress and dist.is_main())
        eos = self.tokenizer.eos_token_id
        while self.state["sft_step"] < total:
            t0 = time.perf_counter()
            try:
                batch = on_main(lambda: sft_batch(source.next_batch(cfg.sft.batch_size), eos,
                                                  self.tokenizer.pad_token_id, cfg.sft.max_len))
            except InputError as e:
                self._save_phase()
                raise InputError(f"{e}\nSFT step {self.state['sft_step']} is checkpointed: fix the input and "
                                 f"continue with --resume") from None
            m = self.trainer.sft_step(batch)
            self.state["sft_step"] += 1
            m["time/step"] = time.perf_counter() - t0
            m["tokens"] = float(batch.num_tokens)
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
            _log(f"SFT done: {total} steps, last loss {m['loss']:.4f}")

    def _save_phase(self) -> None:
        """An SFT checkpoint (``sft_step_N``; ordered before every RL checkpoint)."""
        self.state = dist.broadcast_object(self.state)
        self._save(self.state["sft_step"], "sft")

    # ------------------------------------------------------------------------------------- RL
    def _needs_ref(self) -> bool:
        return self.cfg.grpo.beta > 0

    def start_rl(self) -> None:
        """Everything before the first RL step: the offload's host buffers pinned while the engines start,
        the data and rewards, the optimizer and reference at the RL start, the engines given the
        trainer's weights, the off-policy driver. (Benchmarks call it and then :meth:`rl_step`.)"""
        cfg = self.cfg
        self.trainer.reserve_offload()  # pins the offload's host buffers while the engines start
        self.engine = self._build_engine()
        self.data = PromptSource(cfg.data, self.tokenizer, cfg.seed, exclude=self.held_out) if dist.is_main() else None
        if self.data is not None and self.state.get("data"):
            self.data.load_state_dict(self.state["data"])
        from megaforge.rewards import RewardManager

        self.rewards = RewardManager(cfg.rewards, cfg.algo.plugins) if dist.is_main() else None
        if self.state["rl_step"] == 0:
            total_updates = cfg.max_steps * cfg.trainer.mini_batches * cfg.trainer.epochs
            self.trainer.reset_optimizer(cfg.trainer.lr, total_updates, cfg.trainer.warmup_steps,
                                         cfg.trainer.lr_schedule, cfg.trainer.min_lr)
            if self._needs_ref():
                self.trainer.snapshot_reference()
        if self.cfg.critic_enabled and getattr(self.trainer, "critic", None) is None:
            if not hasattr(self.trainer, "init_critic"):
                raise RunError(f"critic.enabled / algo.advantage={cfg.algo.advantage}: trainer.backend "
                               f"{cfg.trainer.backend} has no critic yet; use trainer.backend torch")
            self.trainer.init_critic()  # a copy of the policy as it starts RL (after SFT)
        # the engine starts from the trainer's weights (after SFT or resume)
        self._sync_weights({})
        self.stop_ids = stop_token_ids(self.tokenizer, cfg.model.path) if dist.is_main() else []
        from megaforge.eval.runner import Evaluator
        from megaforge.loop_offpolicy import build_driver

        self.evaluator = Evaluator(cfg, self.eval_sets, self.tokenizer, self.rewards, self.stop_ids,
                                   os.path.join(self.run_dir, "eval")) if dist.is_main() else None
        self.driver = build_driver(self)  # off_policy / partial rollouts / sync.interval > 1; else None

    def rl(self) -> None:
        cfg = self.cfg
        logger = bar = None
        bad = 0
        try:
            self.start_rl()
            # a run resumed before its first RL step redoes the step-0 evaluation: its old row goes
            resume_step = (self.state["rl_step"] or -1) if self.resumed_from else None
            logger = MetricsLogger(cfg, self.run_dir, resume_step=resume_step) if dist.is_main() else None
            bar = Progress(cfg.max_steps, self.state["rl_step"], "grpo", cfg.metrics.progress and dist.is_main())
            if self.state["rl_step"] == 0:
                before = self._evaluate(0)  # eval.before_train: the starting policy, logged as step 0
                if before and logger is not None:
                    logger.log(0, before)
            while self.state["rl_step"] < cfg.max_steps:
                step = self.state["rl_step"] + 1
                try:
                    m = (self.driver.step if self.driver is not None else self.rl_step)(step, bar)
                except InputError as e:  # met before the trainer changed: the last step's state is whole
                    self._save_rl()
                    raise InputError(f"{e}\nRL step {step - 1} is checkpointed: fix the input and continue "
                                     f"with --resume") from None
                bad = bad + 1 if m.get("skipped", 0.0) > 0 else 0
                self.state["skipped_steps"] += int(m.get("skipped", 0.0) > 0)
                m["health/skipped_steps"] = float(self.state["skipped_steps"])
                self.state["rl_step"] = step
                if self.data is not None and self.driver is None:  # the driver keeps it at rollout boundaries
                    self.state["data"] = self.data.state_dict()
                m.update(self._evaluate(step))  # eval/<set>/... when due: part of the step's row
                if logger is not None:
                    logger.log(step, m)
                bar.update(m)
                if bad >= cfg.trainer.max_bad_steps:
                    raise RunError(f"{bad} consecutive steps had a non-finite loss or gradient "
                                   f"(trainer.max_bad_steps={cfg.trainer.max_bad_steps}); stopping. "
                                   f"Metrics up to step {step} are in {self.run_dir}/metrics.jsonl")
                if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step < cfg.max_steps:
                    self._save_rl()
                if cfg.export_hf_every and step % cfg.export_hf_every == 0:
                    self.trainer.export_hf(os.path.join(self.run_dir, "hf", f"step_{step}"))
                if step < cfg.max_steps and self._stop_requested():
                    self._save_rl()
                    self._stop("RL", step)
            self._save_rl()
        finally:
            self.close_rl(bar, logger)

    def close_rl(self, bar=None, logger=None) -> None:
        """Progress, metrics, driver, rewards and engines closed (whatever :meth:`start_rl` got to)."""
        if bar is not None:
            bar.close()
        if logger is not None:
            logger.close()
        if getattr(self, "driver", None) is not None:
            self.driver.close()
        if getattr(self, "rewards", None) is not None:
            self.rewards.close()
        if self.engine is not None:
            self.engine.shutdown()

    def _evaluate(self, step: int) -> dict:
        """Every rank: the ``eval/...`` metrics of the engine's weights when evaluation is due after
        ``step`` (0: before training), else {} (the metrics stay on the main rank)."""
        from megaforge.eval.runner import is_due

        if not is_due(self.cfg, step):
            return {}

        def run():
            if self.driver is not None:
                self.driver.engine_for_eval()  # the rollout in flight drained, engine memory resumed
            return self.evaluator.run(self.engine, step)

        m = on_main(run, share=False) or {}
        if m:
            _log(f"eval after step {step}: " + ", ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if k.endswith(("pass@1", "/reward/mean"))
                and "/sampled/reward" not in k))
        return m

    def _save_rl(self) -> None:
        if getattr(self, "driver", None) is not None:
            self.driver.before_save()  # drains the rollout in flight into the saved state
        self.state = dist.broadcast_object(self.state)
        self._save(self.state["rl_step"])

    def _generate(self, step: int, n_prompts: int, offset: int, m: dict) -> list:
        """``n_prompts`` prompts x grpo.n_samples scored samples (group ids from ``offset``), with DAPO's
        overlong shaping added to the rewards when ``algo.overlong_buffer`` > 0."""
        cfg = self.cfg
        if self.driver is not None and self.driver.partial is not None:  # rounds that carry unfinished samples
            return self.driver.partial.generate(step, n_prompts, offset, m)
        per_call = cfg.rewards.stream_prompts or n_prompts  # rewards.stream_prompts: rewards overlap generation
        stream = self.rewards.stream() if per_call < n_prompts else None
        with timed(m, "time/rollout"):
            rows = self.data.next_batch(n_prompts)
            samples = []
            for a in range(0, len(rows), per_call):  # the same seeded requests whatever the split
                part = generate_samples(self.engine, rows[a:a + per_call], cfg.grpo.n_samples,
                                        sampling_params(cfg, self.stop_ids), cfg.seed, step, offset + a, self.tokenizer, cfg)
                if stream is not None:
                    stream.add_samples(part)  # scored in the reward workers while the next part generates
                samples += part
        return self._score(samples, m, stream)

    def _score(self, samples: list, m: dict, stream=None) -> list:
        """Rewards (plus DAPO's overlong shaping) of finished samples (already in ``stream`` when it is
        given); metrics added to ``m``."""
        cfg = self.cfg
        for k, v in score(samples, self.rewards, stream).items():  # counts and times add up, means average over rounds
            summed = k in ("reward/errors", "reward/timeouts") or k.startswith("time/")
            m[k] = m.get(k, 0.0) + (v if summed else v * len(samples))
        if cfg.algo.overlong_buffer > 0:
            pen = overlong_penalty(torch.tensor([len(s.response_ids) for s in samples]), cfg.rollout.max_new_tokens,
                                   cfg.algo.overlong_buffer, cfg.algo.overlong_penalty)
            for s, p in zip(samples, pen.tolist()):
                s.reward += p
            m["reward/overlong_penalty"] = m.get("reward/overlong_penalty", 0.0) + float(pen.sum())
        return samples

    def _rollout(self, step: int, m: dict, bar: Progress):
        """Main rank: prompts -> samples with rewards -> TrainBatch (advantages not yet set).

        Dynamic sampling (``algo.dynamic_sampling``, DAPO): groups with equal rewards are dropped and
        more prompts sampled, up to ``algo.dynamic_sampling_max_rounds`` rounds, until
        ``rollout.batch_size`` groups are kept; then the first ``batch_size`` kept groups train. If no
        group survives, the last round's groups train (their advantages are 0)."""
        cfg = self.cfg
        target, n = cfg.rollout.batch_size, cfg.grpo.n_samples
        self.engine.ensure_healthy()  # a dead or hung engine is restarted and re-synced (rollout.max_restarts)
        self.rewards.start_step()
        if not cfg.algo.dynamic_sampling:
            generated = samples = self._generate(step, target, 0, m)
        else:
            generated, samples, rounds, last = [], [], 0, []
            while len(samples) < target * n and rounds < cfg.algo.dynamic_sampling_max_rounds:
                want = target - len(samples) // n
                last = self._generate(step, math.ceil(want * cfg.loop.oversample), len(generated) // n, m)
                generated += last
                keep = nonzero_variance_groups(torch.tensor([s.reward for s in last]),
                                               torch.tensor([s.group_id for s in last]))
                samples += [s for s, k in zip(last, keep.tolist()) if k]
                rounds += 1
            m["dynamic_sampling/rounds"] = float(rounds)
            m["dynamic_sampling/kept_groups"] = float(min(len(samples) // n, target))
            m["dynamic_sampling/generated_groups"] = float(len(generated) // n)
            m["dynamic_sampling/fallback"] = float(not samples)
            if not samples:
                samples = last
            keep = first_groups(torch.tensor([s.group_id for s in samples]), target)
            samples = [s for s, k in zip(samples, keep.tolist()) if k]
        for k in [k for k in m if k.startswith(("reward/", "episode/")) and k not in ("reward/errors", "reward/timeouts")]:
            m[k] /= len(generated)
        self.rewards.check_step(step)  # RewardError (the run stops) when a reward failed on every sample
        if m["reward/errors"] or m["reward/timeouts"]:
            for msg in self.rewards.step_errors.values():  # one line per failing reward, naming it (a service: its URL)
                bar.write(f"[megaforge] step {step}: {msg}")
        r = torch.tensor([s.reward for s in generated])  # metrics describe everything generated
        lens = torch.tensor([len(s.response_ids) for s in generated], dtype=torch.float32)
        m.update({
            "reward/mean": float(r.mean()), "reward/std": float(r.std()) if len(r) > 1 else 0.0,
            "response_len/mean": float(lens.mean()), "response_len/max": float(lens.max()),
            "response/length_frac": sum(s.finish_reason == "length" for s in generated) / len(generated),
            "response/empty_frac": float((lens == 0).float().mean()),
            "data/skipped_rows": float(self.data.skipped), "data/epoch": float(self.data.epoch),
            **self.engine.health_metrics(),
        })
        for s in generated[: cfg.metrics.log_samples]:
            bar.write(f"[step {step}] reward={s.reward:.2f} | {s.prompt_text!r} -> {s.response_text!r}")
        return samples_to_batch(samples, self.tokenizer.pad_token_id)

    def _advantages(self, batch) -> torch.Tensor:
        return batch_advantages(batch, self.cfg)

    def rl_step(self, step: int, bar: Progress) -> dict:
        cfg = self.cfg
        m: dict = {}
        t0 = time.perf_counter()
        peaks: dict = {}
        with memory.phase(peaks, "rollout"):
            batch, m = on_main(lambda: (self._rollout(step, m, bar), m))
        m.update(peaks)
        self._train_batch(batch, m, keep_weights=True)  # the sync right after reads them on the device
        self._sync_weights(m)
        m["weight_version"] = float(self.trainer.version)
        m["time/step"] = time.perf_counter() - t0
        m["throughput/tokens_per_s"] = float(batch.lengths.sum()) / max(m["time/step"], 1e-9)
        m.setdefault("kl", 0.0)
        return m

    def _train_batch(self, batch, m: dict, colocated: bool = True, keep_weights: bool = False) -> None:
        """Reference / old logprobs, values, advantages and the optimizer step(s) on ``batch``. Colocated
        choreography (megaforge.memory): engine memory out, trainer state in, train, trainer state out
        (the weights stay on the device with ``keep_weights``: a weight sync follows)."""
        if self.engine is not None and colocated:
            with timed(m, "time/release"):
                self.engine.release_memory(["weights", "kv_cache"])
        outside = memory.outside_torch_gib()  # contexts, communicators, what the engine did not free
        if outside is not None:
            m["memory/outside_torch_gib"] = outside
        with memory.phase(m, "train"):
            self._train_on_device(batch, m, keep_weights)

    def _train_on_device(self, batch, m: dict, keep_weights: bool) -> None:
        cfg = self.cfg
        with timed(m, "time/onload"):
            self.trainer.onload()
        with timed(m, "time/train"):
            if self._needs_ref():
                batch.ref_logprobs = self.trainer.compute_logprobs(batch, "ref")
            if needs_old_logprobs(cfg):
                batch.old_logprobs = self.trainer.compute_logprobs(batch, "policy")
            if cfg.critic_enabled:
                batch.values = self.trainer.compute_values(batch)
            batch.advantages = self._advantages(batch)
            set_denominators(batch)
            m.update(self.trainer.train_step(batch))
        with timed(m, "time/offload"):
            self.trainer.offload(["state"] if keep_weights else None)

    def _sync_weights(self, m: dict) -> None:
        """Trainer state out (weights on the device), engine weights in, weights streamed, trainer weights
        out and caches released, engine KV cache and CUDA graphs in (megaforge.memory, DESIGN.md)."""
        from megaforge.sync import push_weights

        with memory.phase(m, "sync"):
            with timed(m, "time/offload"):
                self.trainer.offload(["state"])  # already out after a step: nothing to do
            with timed(m, "time/onload"):
                self.trainer.onload(["weights"])  # already in after a step: nothing to do
            if self.engine is not None:
                with timed(m, "time/resume"):
                    self.engine.resume_memory(["weights"])
            with timed(m, "time/sync"):
                push_weights(self.trainer, self.engine, self.cfg.sync.bucket_mb << 20, self.trainer.version,
                             check_equal=self.cfg.sync.check_equal)
            with timed(m, "time/offload"):
                self.trainer.offload(["weights"])
                memory.release_cached()  # IPC blocks and torch's cache back before the engine allocates
        if self.engine is not None:
            with timed(m, "time/resume"):
                self.engine.resume_memory(["kv_cache", "cuda_graph"])


def kl_in_reward(cfg: Config) -> bool:
    """The KL to the reference is a per-token reward penalty (``algo.kl_in_reward`` with beta > 0)."""
    return cfg.algo.kl_in_reward and cfg.grpo.beta > 0


def needs_old_logprobs(cfg: Config) -> bool:
    """The trainer computes pi_old's log-probs before the update: several updates per batch (the ratio
    needs a fixed pi_old), or the KL penalty in the reward (it is taken from them)."""
    return cfg.trainer.mini_batches * cfg.trainer.epochs > 1 or kl_in_reward(cfg)


def batch_advantages(batch, cfg: Config) -> torch.Tensor:
    """``algo.advantage`` of ``batch`` [B, T]; sets ``batch.returns`` (the critic's targets) when the
    batch has critic values. With :func:`kl_in_reward` the token rewards are
    :func:`~megaforge.algorithms.kl.kl_reward_penalty` of the trainer's old log-probs (as verl), not of
    the engine's rollout log-probs."""
    token_rewards = None
    if kl_in_reward(cfg):
        if batch.old_logprobs is None or batch.ref_logprobs is None:
            raise RuntimeError("algo.kl_in_reward: the batch lacks the trainer's old or reference log-probs")
        token_rewards = kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, cfg.grpo.beta,
                                          cfg.algo.kl_estimator)
    inp = AdvantageInputs(rewards=batch.rewards, group_ids=batch.group_ids, loss_mask=batch.loss_mask,
                          token_rewards=token_rewards, values=batch.values)
    if batch.values is not None:  # the critic's targets: lambda-returns
        batch.returns = value_targets(inp, cfg.algo)
    return ADVANTAGES.get(cfg.algo.advantage)(inp, cfg.algo)


def run_grpo(cfg: Config) -> Run:
    run = Run(cfg, "grpo")
    try:
        run.sft()
        if cfg.max_steps > 0:
            run.rl()
        else:
            run._save_rl()
    finally:
        run.close()
    return run


def run_sft(cfg: Config) -> Run:
    run = Run(cfg, "sft")
    try:
        run.sft()
        run._save_phase()
        if cfg.export_hf_every:
            run.trainer.export_hf(os.path.join(run.run_dir, "hf", f"sft_step_{run.state['sft_step']}"))
    finally:
        run.close()
    return run
