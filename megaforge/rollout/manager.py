"""From prompts to scored samples: request fan-out (n per prompt), seeds, decoding, rewards.

:func:`generate_samples` is the one entry the loop uses: single-turn generation, or the configured
``rollout.generate_fn`` (multi-turn / agentic rollouts, :mod:`megaforge.rollout.agent.multiturn`).
"""
from __future__ import annotations

import hashlib
from typing import Optional

from megaforge.rollout import routing
from megaforge.rollout.agent.multiturn import call_generate_fn
from megaforge.specs import GenerateContext
from megaforge.types import GenerateRequest, Sample, SamplingParams


def stop_token_ids(tokenizer, model_dir: str = "") -> list[int]:
    """End-of-turn ids: the tokenizer's EOS plus any of the generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir:
        try:
            from transformers import GenerationConfig

            gc = GenerationConfig.from_pretrained(model_dir)
            e = gc.eos_token_id
            ids.update([e] if isinstance(e, int) else (e or []))
        except (OSError, ValueError):
            pass
    if not ids:
        raise ValueError("the tokenizer has no eos token: generation could never stop")
    return sorted(ids)


def request_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    h = hashlib.blake2b(f"{seed}/{step}/{prompt_index}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF


def make_requests(rows, n: int, base: SamplingParams, seed: int, step: int, group_offset: int = 0,
                  routed_experts: bool = False) -> list[GenerateRequest]:
    reqs = []
    for i, row in enumerate(rows):
        for j in range(n):
            sp = SamplingParams(**{**base.__dict__, "seed": request_seed(seed, step, group_offset + i, j)})
            reqs.append(GenerateRequest(list(row.prompt_ids), sp, rid=f"s{step}-g{group_offset + i}-n{j}",
                                        return_routed_experts=routed_experts))
    return reqs


def completions_to_samples(rows, n: int, completions, tokenizer, group_offset: int = 0,
                           routing_shape: Optional[routing.RoutingShape] = None) -> list[Sample]:
    """Samples of ``completions`` (row-major over ``rows`` x ``n``). ``routing_shape``: each completion's
    routed experts are checked against the model (:func:`megaforge.rollout.routing.check`: RoutingError
    naming the sample) and kept on the sample."""
    samples = []
    for k, c in enumerate(completions):
        row = rows[k // n]
        text = tokenizer.decode(c.output_ids, skip_special_tokens=True)
        table = None
        if routing_shape is not None:
            where = f"sample {k} (request {c.rid or '?'}, group {group_offset + k // n})"
            table = routing.check(c.routed_experts, len(row.prompt_ids) + len(c.output_ids) - 1, routing_shape, where)
        samples.append(Sample(
            prompt_ids=list(row.prompt_ids), response_ids=list(c.output_ids),
            rollout_logprobs=list(c.output_logprobs), group_id=group_offset + k // n,
            finish_reason=c.finish_reason, weight_version=c.weight_version,
            prompt_text=row.prompt_text, response_text=text, label=row.label, routed_experts=table,
        ))
    return samples


def generate_samples(engine, rows, n: int, base: SamplingParams, seed: int, step: int, group_offset: int,
                     tokenizer, ctx: Optional[GenerateContext] = None,
                     routing_shape: Optional[routing.RoutingShape] = None) -> list[Sample]:
    """``len(rows) * n`` unscored samples, row-major (sample k is the ``k % n``-th of row ``k // n``,
    group ``group_offset + k // n``). With ``ctx`` (a :class:`~megaforge.specs.GenerateContext`:
    ``rollout.generate_fn`` is set), that function builds them from the same seeded first-turn requests
    (see :func:`megaforge.rollout.agent.multiturn.call_generate_fn`).
    ``routing_shape`` (rollout.return_routed_experts): the engine also reports each token's routed experts,
    kept on the samples (single-turn only: the config refuses them with rollout.generate_fn)."""
    reqs = make_requests(rows, n, base, seed, step, group_offset, routed_experts=routing_shape is not None)
    if ctx is None:
        return completions_to_samples(rows, n, engine.generate(reqs), tokenizer, group_offset, routing_shape)
    return call_generate_fn(ctx, engine, reqs, rows, n, tokenizer, group_offset)


def score(samples: list[Sample], reward_manager, stream=None) -> dict:
    """Each sample's reward: the configured reward functions on the whole response text (for a
    multi-turn episode: every turn and tool result), plus the environment's episode reward
    ``metadata["env_reward"]`` when a rollout function set one (logged as ``reward/env``).
    ``stream``: a :class:`megaforge.rewards.RewardStream` the samples were already added to, in
    this order, as they were generated (else they are scored here)."""
    if stream is None:
        stream = reward_manager.stream()
        stream.add_samples(samples)
    rewards, metrics = stream.finish()
    if len(rewards) != len(samples):
        raise RuntimeError(f"the reward stream scored {len(rewards)} samples for {len(samples)}")
    env = [float(s.metadata.get("env_reward", 0.0)) for s in samples]
    for s, r, e in zip(samples, rewards, env):
        s.reward = r + e
    if any("env_reward" in s.metadata for s in samples):
        metrics["reward/env"] = sum(env) / max(len(env), 1)
    names = sorted({k for s in samples for k in s.metadata.get("episode", {})})
    for k in names:  # multi-turn episode statistics, e.g. episode/tool_calls
        metrics[f"episode/{k}"] = sum(float(s.metadata.get("episode", {}).get(k, 0.0)) for s in samples) / len(samples)
    return metrics
