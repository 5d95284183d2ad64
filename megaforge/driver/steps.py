"""The step primitives both drivers (:mod:`megaforge.driver.sync`, :mod:`megaforge.driver.offpolicy`)
are made of: :meth:`StepParts.rollout` (prompts -> scored samples -> TrainBatch, with DAPO's dynamic
sampling and the partial-rollout pool), :meth:`StepParts.train` (reference / old log-probs, values,
advantages, the optimizer step(s), with the colocated memory choreography) and :meth:`StepParts.push`
(the trainer's weights to the engine). The order of one step: DESIGN.md "One RL step". Advantages that
read the trainer's per-token results are computed by every rank on its own share
(:func:`share_advantages`): no per-token tensor goes back to the main rank."""
from __future__ import annotations

import math
import sys
import time
from typing import Optional

import torch

from megaforge import collective, memory
from megaforge.algorithms import (ADVANTAGES, AdvantageInputs, Share, first_groups, kl_reward_penalty,
                                  nonzero_variance_groups, overlong_penalty, value_targets,
                                  zero_variance_fraction)
from megaforge.data.batch import per_token_bytes, samples_to_batch, set_denominators
from megaforge.driver.common import timed
from megaforge.driver.handoff import BatchHandOff
from megaforge.rollout.manager import generate_samples, score
from megaforge.rollout.partial import PartialPool
from megaforge.specs import Schedule, StepSettings, expect
from megaforge.sync import push_weights
from megaforge.sync.adapters import push_adapters
from megaforge.types import TrainBatch


class StepParts:
    """The pieces of an RL step over one run's trainer and engine, with the settings they read
    (:class:`~megaforge.specs.StepSettings`, built by :meth:`megaforge.build.RunBuilder.step_settings`).
    ``data`` (the PromptSource), ``rewards`` (the RewardManager) and ``stop_ids`` are the main rank's
    (None / [] elsewhere); so is the partial-rollout pool :attr:`partial` (``loop.partial_rollouts``;
    None otherwise). ``routing_shape``: the policy's (``rollout.return_routed_experts``; None: off).
    :meth:`rollout` runs on the main rank; :meth:`train` and :meth:`push` on every rank (collective);
    so does the constructor (the batch hand-off's :class:`~megaforge.driver.handoff.BatchHandOff`)."""

    def __init__(self, settings: StepSettings, trainer, engine, data, rewards, tokenizer, stop_ids: list,
                 routing_shape=None):
        self.settings = expect(settings, StepSettings, "StepParts")
        self.trainer, self.engine = trainer, engine
        self.data, self.rewards, self.tokenizer, self.stop_ids = data, rewards, tokenizer, stop_ids
        self.handoff = BatchHandOff(*trainer.data_parallel(), settings.mini_batches) if trainer is not None else None
        self.routing_shape = routing_shape
        self.base = settings.sampling.params(stop_ids)  # each request adds its seed
        self.partial = None
        self._graphs = compiled_graphs()  # after the trainer's warm-up (megaforge.loop.start_rl)
        if settings.loop.partial_rollouts and collective.is_main():
            self.partial = PartialPool(engine, data, tokenizer, settings.loop, settings.n_samples,
                                       settings.max_new_tokens, settings.seed, self.score, self.base)

    # ------------------------------------------------------------------------------------ rollout
    def _generate(self, step: int, n_prompts: int, offset: int, m: dict) -> list:
        """``n_prompts`` prompts x grpo.n_samples scored samples (group ids from ``offset``), with DAPO's
        overlong shaping added to the rewards when ``algo.overlong_buffer`` > 0."""
        s = self.settings
        if self.partial is not None:  # rounds that carry unfinished samples
            return self.partial.generate(step, n_prompts, offset, m)
        per_call = s.stream_prompts or n_prompts  # rewards.stream_prompts: rewards overlap generation
        stream = self.rewards.stream() if per_call < n_prompts else None
        with timed(m, "time/rollout"):
            rows = self.data.next_batch(n_prompts)
            samples = []
            for a in range(0, len(rows), per_call):  # the same seeded requests whatever the split
                part = generate_samples(self.engine, rows[a:a + per_call], s.n_samples, self.base, s.seed, step,
                                        offset + a, self.tokenizer, s.generate, self.routing_shape)
                if stream is not None:
                    stream.add_samples(part)  # scored in the reward workers while the next part generates
                samples += part
        return self.score(samples, m, stream)

    def score(self, samples: list, m: dict, stream=None) -> list:
        """Rewards (plus DAPO's overlong shaping) of finished samples (already in ``stream`` when it is
        given); metrics added to ``m``."""
        s = self.settings
        for k, v in score(samples, self.rewards, stream).items():  # counts and times add up, means average over rounds
            summed = k in ("reward/errors", "reward/timeouts") or k.startswith("time/")
            m[k] = m.get(k, 0.0) + (v if summed else v * len(samples))
        if s.overlong_buffer > 0:
            pen = overlong_penalty(torch.tensor([len(x.response_ids) for x in samples]), s.max_new_tokens,
                                   s.overlong_buffer, s.overlong_penalty)
            for x, p in zip(samples, pen.tolist()):
                x.reward += p
            m["reward/overlong_penalty"] = m.get("reward/overlong_penalty", 0.0) + float(pen.sum())
        return samples

    def rollout(self, step: int, m: dict, bar) -> TrainBatch:
        """Main rank: prompts -> samples with rewards -> TrainBatch (advantages not yet set).

        Dynamic sampling (``algo.dynamic_sampling``, DAPO): groups with equal rewards are dropped and
        more prompts sampled, up to ``algo.dynamic_sampling_max_rounds`` rounds, until
        ``rollout.batch_size`` groups are kept; then the first ``batch_size`` kept groups train. If no
        group survives, the last round's groups train (their advantages are 0)."""
        st = self.settings
        target, n = st.batch_size, st.n_samples
        self.engine.ensure_healthy()  # a dead or hung engine is restarted and re-synced (rollout.max_restarts)
        self.rewards.start_step()
        if not st.dynamic_sampling:
            generated = samples = self._generate(step, target, 0, m)
        else:
            generated, samples, rounds, last = [], [], 0, []
            while len(samples) < target * n and rounds < st.dynamic_sampling_max_rounds:
                want = target - len(samples) // n
                last = self._generate(step, math.ceil(want * st.loop.oversample), len(generated) // n, m)
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
            "groups/zero_variance_frac": zero_variance_fraction(r, torch.tensor([s.group_id for s in generated])),
            "data/skipped_rows": float(self.data.skipped), "data/epoch": float(self.data.epoch),
            **self.engine.health_metrics(),
        })
        for s in generated[: st.log_samples]:
            bar.write(f"[step {step}] reward={s.reward:.2f} | {s.prompt_text!r} -> {s.response_text!r}")
        return samples_to_batch(samples, self.tokenizer.pad_token_id)

    # -------------------------------------------------------------------------------------- train
    def train(self, batch: Optional[TrainBatch], m: dict, colocated: bool = True, keep_weights: bool = False) -> None:
        """Reference / old logprobs, values, advantages and the optimizer step(s) on ``batch`` (the
        whole batch on the main rank, None on the others: each rank trains its share,
        :func:`train_share`). Colocated choreography (megaforge.memory): engine memory out, trainer
        state in, train, trainer state out (the weights stay on the device with ``keep_weights``: a
        weight sync follows)."""
        if self.engine is not None and colocated:
            with timed(m, "time/release"):
                self.engine.release_memory(["weights", "kv_cache"])
        outside = memory.outside_torch_gib()  # contexts, communicators, what the engine did not free
        if outside is not None:
            m["memory/outside_torch_gib"] = outside
        with memory.phase(m, "train"):
            with timed(m, "time/onload"):
                self.trainer.onload()
            with timed(m, "time/train"):
                train_share(self.trainer, self.handoff, batch, self.settings, m)
            with timed(m, "time/offload"):
                self.trainer.offload(["state"] if keep_weights else None)

    def push(self, m: dict) -> None:
        """Trainer state out (weights on the device), engine weights in, weights streamed, trainer weights
        out and caches released, engine KV cache and CUDA graphs in (megaforge.memory, DESIGN.md)."""
        with memory.phase(m, "sync"):
            with timed(m, "time/offload"):
                self.trainer.offload(["state"])  # already out after a step: nothing to do
            with timed(m, "time/onload"):
                self.trainer.onload(["weights"])  # already in after a step: nothing to do
            if self.engine is not None:
                with timed(m, "time/resume"):
                    self.engine.resume_memory(["weights"])
            with timed(m, "time/sync"):
                s = self.settings
                if s.lora_adapters:  # the adapters alone; the engine merges (megaforge.sync.adapters)
                    stats = push_adapters(self.trainer, self.engine, s.bucket_mb << 20, self.trainer.version)
                else:
                    stats = push_weights(self.trainer, self.engine, s.bucket_mb << 20, self.trainer.version,
                                         check_equal=s.check_equal)
            m["sync/bytes"] = float(stats["bytes"])
            with timed(m, "time/offload"):
                self.trainer.offload(["weights"])
                memory.release_cached()  # IPC blocks and torch's cache back before the engine allocates
        if self.engine is not None:
            with timed(m, "time/resume"):
                self.engine.resume_memory(["kv_cache", "cuda_graph"])

    def step_metrics(self, m: dict, batch: Optional[TrainBatch], t0: float) -> dict:
        """``m`` completed at the end of a step that began at ``t0`` (``time.perf_counter``) and trained
        ``batch`` (main rank; None elsewhere): the trainer's weight version, the torch.compile graphs
        made since the last step's end (:func:`compiled_graphs`), the step's wall time and (main rank)
        its tokens per second."""
        m["weight_version"] = float(self.trainer.version)
        graphs, self._graphs = self._graphs, compiled_graphs()
        m["compile/new_graphs"] = float(self._graphs - graphs)  # since the last step's end (evaluations included)
        m["time/step"] = time.perf_counter() - t0
        if batch is not None:
            m["throughput/tokens_per_s"] = float(batch.lengths.sum()) / max(m["time/step"], 1e-9)
        m.setdefault("kl", 0.0)
        return m


def compiled_graphs() -> int:
    """torch.compile graphs made so far in this process (dynamo's ``unique_graphs``: the trainer's and an
    in-process engine's); 0 while dynamo was never imported. A step's ``compile/new_graphs`` is the
    difference: compiles in a step after the first (or in step 1, after the trainer's warm-up) are
    shapes or modes that no earlier call met."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def start_rl_trainer(trainer, schedule: Schedule, reference: bool) -> None:
    """The trainer as RL starts (after SFT): a fresh optimizer on ``schedule`` (its updates span
    ``max_steps`` x ``trainer.mini_batches`` x ``trainer.epochs``), and the frozen reference when
    ``reference`` (:attr:`megaforge.specs.StepSettings.needs_ref`: grpo.beta > 0)."""
    s = expect(schedule, Schedule, "start_rl_trainer")
    trainer.reset_optimizer(s.lr, s.total_updates, s.warmup_steps, s.lr_schedule, s.min_lr)
    if reference:
        trainer.snapshot_reference()


def batch_advantages(batch: TrainBatch, s: StepSettings,
                     whole: Optional[tuple[torch.Tensor, torch.Tensor, Share]] = None,
                     teacher_logprobs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``algo.advantage`` of ``batch``'s rows [n, T]: of a whole batch, or of one data-parallel share of
    it when ``whole`` = (the whole batch's rewards [B], its group ids [B], this rank's Share) is given
    (:meth:`~megaforge.driver.handoff.BatchHandOff.sequences`). Sets ``batch.returns`` (the critic's
    targets) when the batch has critic values. With ``s.kl_in_reward`` the token rewards are
    :func:`~megaforge.algorithms.kl.kl_reward_penalty` of the trainer's old log-probs (as verl), not of
    the engine's rollout log-probs. ``teacher_logprobs`` [n, T]: the distillation teacher's, for
    ``algo.advantage: distill`` (with the trainer's old log-probs as the student's). The estimator gets
    ``s.objective`` (an :class:`~megaforge.algorithms.params.ObjectiveParams`, what estimators are typed
    to read), never a config section."""
    s = expect(s, StepSettings, "batch_advantages")
    token_rewards = None
    if s.kl_in_reward:
        if batch.old_logprobs is None or batch.ref_logprobs is None:
            raise RuntimeError("algo.kl_in_reward: the batch lacks the trainer's old or reference log-probs")
        token_rewards = kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, s.beta,
                                          s.kl_estimator)
    rewards, group_ids, share = whole if whole is not None else (batch.rewards, batch.group_ids, None)
    inp = AdvantageInputs(rewards=rewards, group_ids=group_ids, loss_mask=batch.loss_mask,
                          token_rewards=token_rewards, values=batch.values, share=share,
                          logprobs=batch.old_logprobs, teacher_logprobs=teacher_logprobs)
    p = s.objective
    if batch.values is not None:  # the critic's targets: lambda-returns
        batch.returns = value_targets(inp, p)
    adv = ADVANTAGES.get(p.advantage)(inp, p)
    if adv.shape != batch.loss_mask.shape:
        raise ValueError(f"algo.advantage {s.advantage!r} returned advantages of shape {tuple(adv.shape)} "
                         f"for rows of shape {tuple(batch.loss_mask.shape)} (the rows held: AdvantageInputs.loss_mask)")
    return adv


def train_share(trainer, handoff: BatchHandOff, batch: Optional[TrainBatch], s: StepSettings, m: dict) -> TrainBatch:
    """Every rank: the step's training on this rank's share of ``batch`` (whole on the main rank, None
    elsewhere), handed off by ``handoff``. The advantages: the main rank's on the whole batch before
    the hand-off, or every rank's on its share after the log-probs / values
    (``s.advantages_need_trainer``); every per-token result stays on its rank. Adds to ``m`` the
    trainer's metrics, the hand-off's (:func:`handoff_metrics`) and the parts of ``time/train``, each
    on this rank, wall seconds: ``time/train/ref``, ``/pi_old``, ``/values``, ``/teacher`` (the forwards
    before the update, those the step runs; each returns its per-token results on the host, so the
    device's work is inside) and ``time/train/update`` (the optimizer steps: forward, backward, clip,
    step, metrics to the host). Returns the share, with its per-token results."""
    s = expect(s, StepSettings, "train_share")
    if batch is not None:
        set_denominators(batch)
        if not s.advantages_need_trainer:
            batch.advantages = batch_advantages(batch, s)
    share = handoff.share(batch)
    if s.needs_ref:
        with timed(m, "time/train/ref"):
            share.ref_logprobs = trainer.compute_logprobs(share, "ref", positions="trained")
    if s.needs_old_logprobs:
        with timed(m, "time/train/pi_old"):  # the first mini-batch's from its own update, when only the ratio reads it
            trainer.set_old_logprobs(share, every_row=s.kl_in_reward or s.needs_teacher)
    if s.critic:
        with timed(m, "time/train/values"):
            share.values = trainer.compute_values(share)
    teacher_lp = None
    if s.needs_teacher:
        with timed(m, "time/train/teacher"):
            teacher_lp = trainer.teacher_logprobs(share)  # on the trainer or from an engine (teacher.served_by)
        m.update(distill_metrics(share, teacher_lp))
    if s.advantages_need_trainer:
        share_advantages(handoff, share, batch, s, teacher_lp)
    seen = batch if batch is not None and not s.advantages_need_trainer else share  # main: the whole batch
    if seen.advantages is not None:
        m["advantages/nonzero_frac"] = nonzero_advantage_fraction(seen)
    with timed(m, "time/train/update"):
        m.update(trainer.train_step(share))
    m.update(handoff_metrics(handoff, share))
    return share


def distill_metrics(share: TrainBatch, teacher_lp: torch.Tensor) -> dict:
    """``distill/reverse_kl``: the mean over the batch's trained tokens of k_t = log pi_old(y_t) -
    log pi_teacher(y_t) (the single-sample reverse KL, :mod:`megaforge.algorithms.distill`), and
    ``distill/teacher_logprob``: the teacher's mean log-prob of the sampled tokens. Collective (the
    sums over the data-parallel ranks' shares)."""
    mask = (share.loss_mask > 0).to(torch.float64)
    k = (share.old_logprobs.double() - teacher_lp.double()) * mask
    sums = collective.all_reduce_sum(torch.stack([k.sum(), (teacher_lp.double() * mask).sum(), mask.sum()]))
    n = max(float(sums[2]), 1.0)
    return {"distill/reverse_kl": float(sums[0]) / n, "distill/teacher_logprob": float(sums[1]) / n}


def share_advantages(handoff: BatchHandOff, share: TrainBatch, batch: Optional[TrainBatch], s: StepSettings,
                     teacher_logprobs: Optional[torch.Tensor] = None) -> None:
    """Every rank: :func:`batch_advantages` (and the critic's returns) of its own ``share``, with the
    whole batch's rewards and group ids and the sums over the DP ranks that the estimator needs
    (:meth:`~megaforge.driver.handoff.BatchHandOff.sequences`). ValueError on every rank, before any
    collective of the estimator, for an estimator that does not declare it works on a share
    (``ADVANTAGES.register(name, shares=True)``) when there are several DP ranks."""
    name = s.advantage
    if handoff.dp_size > 1 and not ADVANTAGES.declared(name).get("shares"):
        raise ValueError(
            f"algo.advantage {name!r}: with algo.kl_in_reward, the critic or a teacher every data-parallel rank computes "
            f"its share's advantages, and {name!r} does not declare that it can (register it with shares=True "
            "once its batch-wide statistics go through AdvantageInputs.batch_sum / batch_max and its rows "
            "through AdvantageInputs.held)")
    share.advantages = batch_advantages(share, s, handoff.sequences(batch), teacher_logprobs)


def nonzero_advantage_fraction(batch: TrainBatch) -> float:
    """Fraction of ``batch``'s trained tokens (loss_mask [B, T] = 1) whose advantage [B, T] is not 0;
    at 0.0 the policy-gradient term of the step is 0 (only a KL or entropy term can move the policy)."""
    trained = batch.loss_mask > 0
    n = int(trained.sum())
    return float((batch.advantages[trained] != 0).sum()) / n if n else 0.0


def no_signal_warning(s: StepSettings, sft_steps: int, steps: int, last: int, m: dict) -> str:
    """The one line printed after ``steps`` consecutive RL steps (the last: ``last``, its metrics ``m``)
    whose advantages were all 0 (``metrics.warn_no_signal_steps``): what it means and what to change
    (``sft_steps``: ``sft.max_steps``)."""
    head = (f"megaforge: warning: RL steps {last - steps + 1}-{last}: every advantage was 0 (groups/zero_variance_frac "
            f"{m.get('groups/zero_variance_frac', float('nan')):.2f}, reward/mean {m.get('reward/mean', float('nan')):.3g}), "
            f"so the policy gets no gradient and this run cannot learn; ")
    if m.get("reward/std", 0.0) == 0.0:
        return head + (f"every response scored {m.get('reward/mean', 0.0):.3g}: warm start the model on the task "
                       f"(sft.max_steps > 0, now {sft_steps}), give easier prompts (data.path) or a reward "
                       f"with partial credit (rewards.functions)")
    return head + (f"responses to the same prompt scored alike: raise grpo.n_samples (now {s.n_samples}) or "
                   f"grpo.temperature (now {s.sampling.temperature:g})")


def handoff_metrics(handoff: BatchHandOff, share: TrainBatch) -> dict:
    """``handoff/bytes_received`` (this rank's, in the step's hand-off, the advantages' broadcast and
    all-reduces included), ``handoff/per_token_bytes`` (host bytes of the share's per-token tensors
    after the passes), and
    the largest of each over the ranks (``..._max``: the main rank logs its own). Collective."""
    mine = [handoff.received, per_token_bytes(share)]
    every = collective.all_gather_ints(mine)
    return {"handoff/bytes_received": float(mine[0]), "handoff/per_token_bytes": float(mine[1]),
            "handoff/bytes_received_max": float(max(e[0] for e in every)),
            "handoff/per_token_bytes_max": float(max(e[1] for e in every)),
            "handoff/bytes_sent": float(handoff.sent)}
