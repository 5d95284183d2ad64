"""Multi-turn (agentic) rollouts: the ``rollout.generate_fn`` interface and a tool-calling driver.

The interface. ``rollout.generate_fn: package.module:callable`` names a function

    fn(engine, requests, rows, tokenizer, ctx, **rollout.generate_kwargs) -> list[Sample]

* ``requests[k]`` is the first turn of sample k (prompt ids, seeded SamplingParams with
  ``max_new_tokens = rollout.max_new_tokens`` and the stop ids, rid); sample k belongs to
  ``rows[k // ctx.n_samples]`` (a PromptRow: ``prompt_ids``, ``prompt_text``, ``label``).
* ``ctx`` is a :class:`~megaforge.specs.GenerateContext`, not the whole configuration: its fields are
  ``generate_fn``, ``max_new_tokens`` (``rollout.max_new_tokens``), ``max_turns`` (``rollout.max_turns``),
  ``max_tool_tokens`` (``rollout.max_tool_tokens``), ``n_samples`` (``grpo.n_samples``), ``temperature``
  (``grpo.temperature``), ``seed``, ``model_path`` (``model.path``) and ``generate_kwargs``. Anything
  else the function needs comes through ``rollout.generate_kwargs``; reading another attribute
  (``ctx.data``, ``ctx.rollout``: the whole configuration older versions passed) raises AttributeError
  listing the fields.
* It returns one :class:`Sample` per request, in order: ``prompt_ids`` = the row's prompt,
  ``response_ids`` = everything after it (model turns and environment tokens, at most
  rollout.max_new_tokens), ``rollout_logprobs`` (0.0 on environment tokens), ``response_mask`` (1 on
  tokens the model sampled, 0 on environment tokens: those are never trained, as
  ``data.batch.samples_to_batch`` zeroes their loss mask), ``finish_reason``, ``weight_version`` (the
  oldest version it used) and ``response_text`` (what the reward functions score: the whole episode).
  Optional: ``metadata["env_reward"]`` (added to the reward, logged as ``reward/env``) and
  ``metadata["episode"]`` ({name: number}, averaged into ``episode/<name>`` metrics).
* The caller sets ``group_id`` and ``label`` and checks the rest (:func:`call_generate_fn`).
* With an HTTP engine (``embedded_server`` or ``sglang``), ``engine.openai_base_urls[0]`` and
  ``engine.api_key`` let it use an OpenAI client (``/v1/completions``, ``/v1/chat/completions``):
  ``examples/openai_client/generate_fn.py``.

The tool driver. :func:`tool_rollout` (``rollout.generate_fn: megaforge.rollout.agent.multiturn:tool_rollout``,
``rollout.generate_kwargs: {tools: [calculator]}``) runs one :class:`ToolEnv` per sample through
:func:`run_episodes`:

    for turn in 1 .. rollout.max_turns:
        one engine batch: each unfinished episode's context (prompt + response so far) -> the
            model's turn, which ends at a stop token, at the env's stop string (``</tool>``), after
            ``max_turn_tokens`` tokens (a generate_kwargs key; 0: no per-turn limit) or at the
            response budget rollout.max_new_tokens - |response|
        observation, done, reward = env.step(turn text)
        not done: the observation's tokens, cut to rollout.max_tool_tokens and to the budget, are
            appended with response_mask 0 and logprob 0

An episode ends when the model ends its turn with a stop token, the env says done (no tool call),
the budget is spent (``length``) or the turn limit is reached with a call pending (``length``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from megaforge.registry import import_callable
from megaforge.specs import GenerateContext, expect
from megaforge.rollout.agent.tools import build_tools, parse_call
from megaforge.types import GenerateRequest, Sample, SamplingParams


class Env(Protocol):
    """One episode's environment."""

    stop: list[str]  # stop strings that end a model turn (e.g. the tool call's close tag)

    def step(self, text: str) -> tuple[Optional[str], bool, float]:
        """The model's turn text -> (observation appended as environment tokens, done, reward)."""


class ToolEnv:
    """Answers ``<tool>NAME: ARGS</tool>`` with ``<result>OUTPUT</result>``; a turn without a call ends
    the episode. No reward of its own (the reward functions score the episode text)."""

    gives_reward = False

    def __init__(self, tools: dict, open_tag: str = "<tool>", close_tag: str = "</tool>",
                 result_format: str = "<result>{}</result>"):
        self.tools, self.open_tag, self.close_tag, self.result_format = tools, open_tag, close_tag, result_format
        self.stop = [close_tag]
        self.calls = self.errors = 0

    def step(self, text: str) -> tuple[Optional[str], bool, float]:
        call = parse_call(text, self.open_tag, self.close_tag)
        if call is None:
            return None, True, 0.0
        name, args = call
        tool = self.tools.get(name)
        if tool is None:
            out = f"error: unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        else:
            try:
                out = str(tool(args))
            except Exception as e:  # noqa: BLE001  (a tool's failure is the model's observation, not a crash)
                out = f"error: {type(e).__name__}: {e}"
        self.calls += 1
        self.errors += out.startswith("error:")
        return self.result_format.format(out), False, 0.0

    def metrics(self) -> dict:
        return {"tool_calls": float(self.calls), "tool_errors": float(self.errors), "used_tool": float(self.calls > 0)}


def _turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    if seed is None or turn == 0:
        return seed
    h = hashlib.blake2b(f"{seed}/turn/{turn}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF


@dataclass
class _Episode:
    prompt: list[int]
    resp: list[int] = field(default_factory=list)
    lp: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: Optional[str] = None
    turns: int = 0
    reward: float = 0.0


def run_episodes(engine, requests: Sequence[GenerateRequest], envs: Sequence, tokenizer, max_new_tokens: int,
                 max_turns: int, max_tool_tokens: int, max_turn_tokens: int = 0) -> list[Sample]:
    """Drive one env per request for up to ``max_turns`` model turns (one engine batch per turn)."""
    eps = [_Episode(list(r.input_ids)) for r in requests]
    for turn in range(max_turns):
        active = [i for i, e in enumerate(eps) if e.finish is None]
        if not active:
            break
        reqs = []
        for i in active:
            e, base = eps[i], requests[i].sampling
            room = max_new_tokens - len(e.resp)
            sp = SamplingParams(**{**base.__dict__, "max_new_tokens": min(room, max_turn_tokens or room),
                                   "stop": list(base.stop) + list(envs[i].stop), "seed": _turn_seed(base.seed, turn)})
            reqs.append(GenerateRequest(e.prompt + e.resp, sp, rid=f"{requests[i].rid}-t{turn}"))
        for i, c in zip(active, engine.generate(reqs)):
            e, stop_ids = eps[i], set(requests[i].sampling.stop_token_ids)
            e.turns += 1
            e.resp += list(c.output_ids)
            e.lp += list(c.output_logprobs)
            e.mask += [1] * len(c.output_ids)
            e.versions.append(int(c.weight_version))
            if c.finish_reason == "abort":
                e.finish = "abort"
                continue
            obs, done, r = envs[i].step(tokenizer.decode(c.output_ids, skip_special_tokens=True))
            e.reward += float(r)
            eos = bool(c.output_ids) and c.output_ids[-1] in stop_ids
            room = max_new_tokens - len(e.resp)
            if eos or done or obs is None:
                e.finish = "stop" if (eos or c.finish_reason == "stop") else c.finish_reason
            elif room <= 0 or turn == max_turns - 1:
                e.finish = "length"  # a call is pending but the budget or the turn limit is spent
            else:
                ids = list(tokenizer(obs, add_special_tokens=False)["input_ids"])[:min(max_tool_tokens, room)]
                e.resp += ids
                e.lp += [0.0] * len(ids)
                e.mask += [0] * len(ids)
                if len(e.resp) >= max_new_tokens:
                    e.finish = "length"
    out = []
    for e, env, r in zip(eps, envs, requests):
        meta = {"episode": {"turns": float(e.turns), **(env.metrics() if hasattr(env, "metrics") else {})}}
        if getattr(env, "gives_reward", True):
            meta["env_reward"] = e.reward
        out.append(Sample(prompt_ids=list(r.input_ids), response_ids=e.resp, rollout_logprobs=e.lp, group_id=0,
                          finish_reason=e.finish or "length", weight_version=min(e.versions, default=0),
                          response_mask=e.mask, response_text=tokenizer.decode(e.resp, skip_special_tokens=True),
                          metadata=meta))
    return out


def tool_rollout(engine, requests, rows, tokenizer, ctx: GenerateContext, tools=("calculator",),
                 open_tag: str = "<tool>", close_tag: str = "</tool>", result_format: str = "<result>{}</result>",
                 max_turn_tokens: int = 0) -> list[Sample]:
    """The built-in tool-use rollout function (see the module docstring); ``tools``: names,
    ``package.module:callable`` paths or ``{name, kwargs}`` (:func:`megaforge.rollout.agent.tools.build_tools`)."""
    table = build_tools(tools)
    envs = [ToolEnv(table, open_tag, close_tag, result_format) for _ in requests]
    ctx = expect(ctx, GenerateContext, "tool_rollout (a rollout.generate_fn)")
    return run_episodes(engine, requests, envs, tokenizer, ctx.max_new_tokens, ctx.max_turns, ctx.max_tool_tokens,
                        max_turn_tokens)


def call_generate_fn(ctx: GenerateContext, engine, requests, rows, n: int, tokenizer, group_offset: int) -> list[Sample]:
    """Call ``rollout.generate_fn`` (``ctx.generate_fn``, with ``ctx`` and ``generate_kwargs``) and check its
    answer against the interface (errors name the key). The function is looked up at each call: its module
    is imported once (``sys.modules``), so no cache here."""
    ctx = expect(ctx, GenerateContext, "call_generate_fn")
    path = ctx.generate_fn
    samples = import_callable(path, "rollout.generate_fn")(engine, list(requests), list(rows), tokenizer, ctx,
                                                           **dict(ctx.generate_kwargs))
    if not isinstance(samples, list) or len(samples) != len(requests) or not all(isinstance(s, Sample) for s in samples):
        raise ValueError(f"rollout.generate_fn {path!r} must return a list of {len(requests)} Samples (one per "
                         f"request), got {type(samples).__name__} of {len(samples) if hasattr(samples, '__len__') else '?'}")
    for k, s in enumerate(samples):
        row = rows[k // n]
        if list(s.prompt_ids) != list(row.prompt_ids):
            raise ValueError(f"rollout.generate_fn {path!r}: sample {k} changed the prompt ids (put every turn in response_ids)")
        if any(v not in (0, 1) for v in s.response_mask):
            raise ValueError(f"rollout.generate_fn {path!r}: sample {k}: response_mask must hold 0/1")
        if len(s.response_ids) > ctx.max_new_tokens:
            raise ValueError(f"rollout.generate_fn {path!r}: sample {k} has {len(s.response_ids)} response tokens > "
                             f"rollout.max_new_tokens {ctx.max_new_tokens}")
        s.group_id, s.label = group_offset + k // n, row.label
        s.prompt_text = s.prompt_text or row.prompt_text
    return samples
