"""The distillation teacher served by an inference engine (``teacher.served_by: engine``).

Instead of a frozen copy on the trainer's device (:mod:`megaforge.trainer.teacher`), an engine returns
the *prompt log-probs* of the student's sequences: for each row b of a batch, the tokens x =
``tokens[b, :lengths[b]]`` (prompt + sampled answer) are sent as a prompt and the engine answers
lp_t = log pi_teacher(x_t | x_<t) for 1 <= t < L (nothing for t = 0). :meth:`ServedTeacher.logprobs`
lays them out as ``Trainer.compute_logprobs(batch, "teacher", positions="trained")`` does: token-aligned
[n, T] float32, lp_t at trained positions (loss_mask > 0), 0 elsewhere.

Engines (:func:`build_served_teacher`):

* ``teacher.url`` empty: an embedded engine (:class:`megaforge.rollout.embedded.engine.EmbeddedEngine`)
  holding the teacher (loaded and checked as the trainer-side one: :func:`~megaforge.trainer.teacher.
  load_torch_teacher`) on ``rollout.device``; log-probs at ``grpo.temperature`` (logits / T), as the
  trainer-side teacher's.
* ``teacher.url``: the SGLang server there, ``POST /generate`` with ``input_ids`` (a batch),
  ``sampling_params [{"max_new_tokens": 0}]``, ``return_logprob true``, ``logprob_start_len 0``; its
  answer items carry ``meta_info.input_token_logprobs = [[None, x_0, null], [lp_1, x_1, null], ...]``
  (sglang 0.5.16: the scheduler's ``[None] + input_token_logprobs[:-1]``; token ids >= vocab_size - 1
  come back as 0). SGLang takes them from the raw logits (temperature 1), so the config requires
  grpo.temperature 1.0 there. The teacher's tokenizer is still checked against the student's from
  ``teacher.path`` (:func:`~megaforge.trainer.teacher.check_vocabulary`).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

import torch

from megaforge.types import TrainBatch

Scorer = Callable[[list[list[int]]], list[list[Optional[float]]]]


class ServedTeacher:
    """``score(rows)`` -> per row ``[None, lp_1, ..., lp_{L-1}]``; ``what`` names the engine in errors;
    ``engine`` the in-process engine behind ``score`` (None for a server)."""

    def __init__(self, score: Scorer, what: str, engine=None):
        self.score, self.what, self.engine = score, what, engine

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[n, T] float32 teacher log-probs of ``batch``'s tokens at its trained positions (0 elsewhere)."""
        n, T = batch.tokens.shape
        lengths = batch.lengths.tolist()
        rows = [batch.tokens[b, :lengths[b]].tolist() for b in range(n)]
        got = self.score(rows)
        if len(got) != n:
            raise RuntimeError(f"megaforge: error: teacher {self.what}: {len(got)} answers for {n} sequences")
        out = torch.zeros(n, T, dtype=torch.float32)
        for b, (row, lp) in enumerate(zip(rows, got)):
            if len(lp) != len(row) or (row and lp[0] is not None) or any(v is None for v in lp[1:]):
                raise RuntimeError(f"megaforge: error: teacher {self.what}: sequence {b} ({len(row)} tokens) got "
                                   f"{len(lp)} prompt log-probs, expected None then {len(row) - 1} numbers")
            if len(row) > 1:
                out[b, 1:len(row)] = torch.tensor(lp[1:], dtype=torch.float32)
        return out * (batch.loss_mask > 0)


def build_served_teacher(teacher, model, rollout, temperature: float, tokenizer=None) -> ServedTeacher:
    """The engine of ``teacher.served_by: engine`` (see the module docstring). Reads the ``teacher``
    section, the student's ``model`` section (the vocabulary check, an HF teacher's loading options),
    ``rollout.device`` and ``rollout.engine_batch_size`` (``rollout``: the section) and
    ``grpo.temperature`` (``temperature``)."""
    from megaforge.trainer.teacher import check_vocabulary, load_torch_teacher, locate

    if teacher.url:
        url = teacher.url
        check_vocabulary(model, locate(teacher, model), tokenizer)
        return ServedTeacher(lambda rows: sglang_prompt_logprobs(url, rows), f"SGLang {url}")
    from megaforge.rollout.embedded.engine import EmbeddedEngine
    from megaforge.hf import resolve_device

    net = load_torch_teacher(teacher, model, resolve_device(rollout.device), tokenizer)
    engine = EmbeddedEngine(net, tokenizer, max_batch=rollout.engine_batch_size, fast="off")
    return ServedTeacher(lambda rows: engine.prompt_logprobs(rows, temperature),
                         f"embedded engine ({teacher.path})", engine)


def sglang_request(rows: list[list[int]]) -> dict:
    """The ``/generate`` body asking prompt log-probs of ``rows`` and no new token (sglang 0.5.16
    ``GenerateReqInput``: ``input_ids``, ``sampling_params``, ``return_logprob``, ``logprob_start_len``)."""
    return {"input_ids": rows, "sampling_params": [{"max_new_tokens": 0} for _ in rows],
            "return_logprob": True, "logprob_start_len": 0}


def parse_prompt_logprobs(answer, rows: list[list[int]], where: str) -> list[list[Optional[float]]]:
    """Each answer item's ``meta_info.input_token_logprobs`` values, checked against ``rows`` (same length,
    same token ids, where SGLang reports an id >= vocab_size - 1 as 0)."""
    if not isinstance(answer, list) or len(answer) != len(rows):
        raise RuntimeError(f"megaforge: error: {where}: expected {len(rows)} answer items, got "
                           f"{len(answer) if isinstance(answer, list) else type(answer).__name__}")
    out = []
    for b, (item, row) in enumerate(zip(answer, rows)):
        try:
            entries = item["meta_info"]["input_token_logprobs"]
        except (KeyError, TypeError):
            raise RuntimeError(f"megaforge: error: {where}: answer item {b} has no meta_info.input_token_logprobs "
                               "(return_logprob with logprob_start_len 0 was asked)") from None
        ids = [int(e[1]) for e in entries]
        if len(ids) != len(row) or any(i != t and i != 0 for i, t in zip(ids, row)):
            raise RuntimeError(f"megaforge: error: {where}: answer item {b}'s input_token_logprobs are not of the "
                               f"{len(row)} tokens sent (got {len(ids)} tokens)")
        out.append([None if e[0] is None else float(e[0]) for e in entries])
    return out


def sglang_prompt_logprobs(url: str, rows: list[list[int]], timeout_s: float = 600.0) -> list[list[Optional[float]]]:
    """Prompt log-probs of ``rows`` from the SGLang server at ``url`` (one batch ``/generate``)."""
    from megaforge.rollout.http.client import SGLangClient

    async def run():
        client = SGLangClient(url, timeout_s=timeout_s)
        try:
            return await client.generate(sglang_request(rows))
        finally:
            await client.close()

    return parse_prompt_logprobs(asyncio.run(run()), rows, f"teacher.url {url}/generate")
