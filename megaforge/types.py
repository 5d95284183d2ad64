"""The records that flow between megaforge's parts.

Conventions used everywhere (both trainer backends, every engine, every algorithm):

* A *sequence* is ``prompt_ids + response_ids`` (multi-turn: prompt, then turns of model tokens and
  tool/environment tokens).
* Per-token tensors of a TrainBatch are **token-aligned**: entry ``[b, t]`` belongs to token
  ``tokens[b, t]``. So ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])`` for ``t >= 1`` and is 0
  at ``t = 0`` and on padding. ``loss_mask[b, t] = 1`` exactly where token ``t`` was sampled by the
  policy (its logprob is trained); prompt tokens, tool outputs and padding have 0.
* Batches are right-padded to a common length ``T``; ``lengths[b]`` is the real length of row ``b``.
  A backend that packs sequences (Megatron) packs from ``tokens`` and ``lengths`` itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class SamplingParams:
    """Sampling controls shared by every engine (names follow SGLang's ``sampling_params``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k truncation
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None

    def to_sglang(self) -> dict:
        """The ``sampling_params`` object of SGLang's ``/generate``."""
        d = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k if self.top_k and self.top_k > 0 else -1,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if self.stop:
            d["stop"] = list(self.stop)
        if self.seed is not None:
            d["sampling_seed"] = int(self.seed)
        return d


@dataclass
class GenerateRequest:
    """One generation: a single sample for one prompt (n samples = n requests)."""

    input_ids: list[int]
    sampling: SamplingParams
    rid: str = ""
    return_routed_experts: bool = False  # also report the experts each token was routed to (MoE)

    def __post_init__(self):
        ids = self.input_ids
        if isinstance(ids, tuple):
            ids = self.input_ids = list(ids)
        if not isinstance(ids, list):
            what = type(ids).__name__
            hint = (": a tokenizer's output holds them under ['input_ids'] (tokenizer(text)['input_ids'], one "
                    "prompt)" if hasattr(ids, "keys") else "")
            raise TypeError(f"GenerateRequest.input_ids must be a list of token ids (int), not a {what}{hint}")
        bad = next((i for i, t in enumerate(ids) if type(t) is not int), None)
        if bad is not None:
            t = ids[bad]
            hint = (" (a batch: one GenerateRequest per prompt)" if isinstance(t, (list, tuple))
                    else " (convert with int(...) or .tolist())" if hasattr(t, "__index__") else "")
            raise TypeError(f"GenerateRequest.input_ids[{bad}] is a {type(t).__name__} ({t!r:.40}), not an int: pass "
                            f"a list of token ids{hint}")


@dataclass
class Completion:
    """What an engine returns for one GenerateRequest."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]  # logprob of each output token under the sampling distribution used
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int = 0
    text: str = ""
    # with GenerateRequest.return_routed_experts: [prompt + output - 1, layers, topk] (or [n, layers * topk])
    # integer expert ids of every token the engine ran through the model (megaforge.rollout.routing)
    routed_experts: Optional[torch.Tensor] = None


@dataclass
class Sample:
    """One rollout sample with everything the loss and the metrics need."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token
    group_id: int
    finish_reason: str = "stop"
    weight_version: int = 0
    reward: float = 0.0
    # per response token: 1 = sampled by the policy (trained), 0 = tool/env output (not trained).
    response_mask: Optional[list[int]] = None
    prompt_text: str = ""
    response_text: str = ""
    label: Any = None
    metadata: dict = field(default_factory=dict)
    # rollout.return_routed_experts: [len(prompt) + len(response) - 1, layers, topk] int16 expert ids
    # (megaforge.rollout.routing), checked at the engine boundary
    routed_experts: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.response_mask is None:
            self.response_mask = [1] * len(self.response_ids)
        if len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(
                f"sample of group {self.group_id}: {len(self.rollout_logprobs)} rollout logprobs for "
                f"{len(self.response_ids)} response tokens"
            )
        if len(self.response_mask) != len(self.response_ids):
            raise ValueError(
                f"sample of group {self.group_id}: response_mask has {len(self.response_mask)} entries "
                f"for {len(self.response_ids)} response tokens"
            )


@dataclass(frozen=True)
class MiniBatchPart:
    """One data-parallel rank's part of one mini-batch, in that rank's share of a batch: rows
    [lo, hi) of the share, and of the whole mini-batch (every DP rank's rows together) its row count
    ``size``, trained tokens ``num_tokens`` and sequences with a trained token ``num_seqs`` (the
    denominators of its loss)."""

    lo: int
    hi: int
    size: int
    num_tokens: int
    num_seqs: int


@dataclass
class TrainBatch:
    """A right-padded batch of sequences; every per-token tensor is [B, T] and token-aligned."""

    tokens: torch.Tensor  # [B, T] long
    lengths: torch.Tensor  # [B] long
    loss_mask: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B, T] float
    rollout_logprobs: torch.Tensor  # [B, T] float (0 where loss_mask is 0)
    old_logprobs: Optional[torch.Tensor] = None  # [B, T] trainer logprobs before the update
    ref_logprobs: Optional[torch.Tensor] = None  # [B, T] frozen reference policy
    values: Optional[torch.Tensor] = None  # [B, T] critic values (PPO)
    returns: Optional[torch.Tensor] = None  # [B, T] critic targets (PPO)
    rewards: Optional[torch.Tensor] = None  # [B] sequence rewards
    group_ids: Optional[torch.Tensor] = None  # [B] long
    weight_versions: Optional[torch.Tensor] = None  # [B] long
    # [B, T, layers, topk] int16: the rollout engine's experts for token (b, t) as the model's input,
    # -1 where it has none (t >= L_b - 1, padding); rollout.return_routed_experts (megaforge.rollout.routing)
    routed_experts: Optional[torch.Tensor] = None
    # Set by the loop before training so that micro-batch losses add up to the global objective:
    num_tokens: int = 0  # sum of loss_mask over the *global* batch (all DP ranks)
    num_seqs: int = 0  # sequences with at least one trained token, global
    # Set on one data-parallel rank's *share* of a batch (megaforge.data.batch.share_of): the rank's
    # part of every mini-batch. None: a whole batch (every rank may hold all of it).
    minis: Optional[tuple[MiniBatchPart, ...]] = None
    # Set on a share by Trainer.set_old_logprobs: its first mini-batch's rows have no pi_old in old_logprobs
    # (0): the first update runs at pi_old's weights, so its own forward's log-probs, detached, are pi_old
    old_from_first_update: bool = False

    TENSOR_FIELDS = (
        "tokens", "lengths", "loss_mask", "advantages", "rollout_logprobs", "old_logprobs",
        "ref_logprobs", "values", "returns", "rewards", "group_ids", "weight_versions",
        "routed_experts",
    )
    #: the tensor fields with one value per row ([B]); every other one is per token ([B, T, ...])
    ROW_FIELDS = ("lengths", "rewards", "group_ids", "weight_versions")

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_share(self) -> bool:
        """One data-parallel rank's share of a batch (:attr:`minis` set), not a whole batch."""
        return self.minis is not None

    def select(self, index) -> "TrainBatch":
        """Rows ``index`` (slice, list, range or LongTensor), trimmed to their longest row (a whole batch:
        no longer a share). A list or range of consecutive ascending rows (one data-parallel rank's share is
        every row) is taken as a slice: views, not one gathered copy per field on the host."""
        if isinstance(index, (list, range)):
            rows = list(index)
            if rows and all(type(r) is int for r in rows) and rows == list(range(rows[0], rows[0] + len(rows))):
                index = slice(rows[0], rows[0] + len(rows))
        out = self.apply(lambda v: v[index]).trimmed()
        out.minis, out.old_from_first_update = None, False
        return out

    def trimmed(self) -> "TrainBatch":
        """Drop trailing columns that are padding in every row."""
        if self.batch_size == 0:
            return self
        t = int(self.lengths.max())
        if t == self.tokens.shape[1]:
            return self
        return self.apply(lambda v: v[:, :t] if v.dim() >= 2 else v)

    def apply(self, fn) -> "TrainBatch":
        """A batch with ``fn(tensor)`` for every tensor field that is set (counts unchanged)."""
        kw = {n: (None if getattr(self, n) is None else fn(getattr(self, n))) for n in self.TENSOR_FIELDS}
        return TrainBatch(**kw, num_tokens=self.num_tokens, num_seqs=self.num_seqs, minis=self.minis,
                          old_from_first_update=self.old_from_first_update)

    def to(self, device) -> "TrainBatch":
        return self.apply(lambda v: v.to(device))

    def replace(self, **kw) -> "TrainBatch":
        return dataclasses.replace(self, **kw)
