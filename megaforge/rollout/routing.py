"""Routed experts: which experts a rollout engine sent every token to, as the trainer replays them.

Wire format (sglang 0.5.16, ``return_routed_experts`` on ``/generate``; read in its
``srt/state_capturer/routed_experts.py``, ``managers/scheduler_components/batch_result_processor.py``
and ``managers/detokenizer_manager.py``): ``meta_info["routed_experts"]`` is the base64 text of int32
values (native byte order, C order) shaped

    [n, L, K]    n = prompt + output tokens - 1, L = num_hidden_layers, K = num_experts_per_tok

Row i is the routing of token i of ``prompt + output`` as the model's input (SGLang covers
``[routed_experts_start_len = 0, seqlen - 1)``: the last sampled token never goes through the model).
Every layer has a row; a dense layer's is 0 (SGLang's capture buffer is zero-initialised and only MoE
layers write into it). Expert ids are global, in [0, num_experts). The embedded engine reports its
own routing in the same format (:mod:`megaforge.rollout.embedded.engine`, its server the same text).

:func:`decode` reads the text into [n, L*K] int32 (the token count is checked: the table must
divide into n rows); :func:`check` is the boundary check of a sample's table against the model
(shape [n, L, K], ids in range) and names the sample when it fails.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megaforge.configtree import ConfigError

#: the dtype a sample's routing is kept in from the boundary on (half of SGLang's int32; ids < 2**15)
DTYPE = torch.int16
#: the routing value of a position that has none (padding, a row's last token)
NONE = -1


class RoutingError(ValueError):
    """A routing table that does not fit its sample or the model (the message names the sample)."""


@dataclass(frozen=True)
class RoutingShape:
    """What a routing table of the model looks like: [n, layers, topk], ids < num_experts."""

    layers: int
    topk: int
    num_experts: int
    moe_layers: tuple  # per layer: True = MoE (has a routing), False = dense (rows of 0)


def routing_shape(hf_cfg) -> Optional[RoutingShape]:
    """The routing shape of an HF config (None: a dense model)."""
    from megaforge.convert import families  # lazy: the model families, only where routing is on

    desc = families.family_of(hf_cfg).describe(hf_cfg)
    if not desc.is_moe:
        return None
    if desc.num_experts >= 1 << 15:
        raise RoutingError(f"{desc.num_experts} experts do not fit megaforge's int16 routing tables")
    return RoutingShape(desc.num_layers, desc.topk, desc.num_experts, tuple(bool(m) for m in desc.moe_layers))


def encode(table: torch.Tensor) -> str:
    """SGLang's text of a routing table (any integer dtype, [n, L, K]): base64 of its int32 values."""
    return base64.b64encode(table.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode(text, n_tokens: int, where: str) -> torch.Tensor:
    """[n_tokens, R] int32 from SGLang's text (R = L * K values per token); RoutingError naming
    ``where`` when it is not base64 text of whole int32 rows for ``n_tokens`` tokens."""
    if not isinstance(text, str):
        raise RoutingError(f"{where}: meta_info.routed_experts is {type(text).__name__}, expected base64 text "
                           "(was the server started with --enable-return-routed-experts?)")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as e:
        raise RoutingError(f"{where}: meta_info.routed_experts is not base64: {e}") from None
    if len(raw) % 4:
        raise RoutingError(f"{where}: meta_info.routed_experts has {len(raw)} bytes, not whole int32 values")
    vals = np.frombuffer(raw, dtype=np.int32)
    if n_tokens < 1 or vals.size % n_tokens or vals.size == 0:
        raise RoutingError(f"{where}: meta_info.routed_experts has {vals.size} values, not a whole row for each of "
                           f"the {n_tokens} tokens it covers (prompt + output - 1)")
    return torch.from_numpy(vals.copy()).view(n_tokens, -1)


def check(table, n_tokens: int, shape: RoutingShape, where: str) -> torch.Tensor:
    """A sample's routing as [n_tokens, L, K] :data:`DTYPE`, from [n_tokens, L, K] or [n_tokens, L*K]
    integers; RoutingError naming ``where`` for a missing table, a wrong token count, width or dtype,
    or an expert id out of [0, num_experts) in a MoE layer."""
    if table is None:
        raise RoutingError(f"{where}: the engine returned no routed experts (rollout.return_routed_experts is set)")
    if not isinstance(table, torch.Tensor) or table.dtype.is_floating_point or table.dtype == torch.bool:
        raise RoutingError(f"{where}: routed experts must be an integer tensor, got "
                           f"{getattr(table, 'dtype', type(table).__name__)}")
    L, K = shape.layers, shape.topk
    if table.dim() == 2 and table.shape[0] == n_tokens and table.shape[1] == L * K:
        table = table.view(n_tokens, L, K)
    if tuple(table.shape) != (n_tokens, L, K):
        raise RoutingError(f"{where}: routed experts of shape {tuple(table.shape)}, expected [{n_tokens} tokens "
                           f"(prompt + response - 1), {L} layers, {K} experts per token]")
    moe = torch.tensor(shape.moe_layers, dtype=torch.bool)
    ids = table[:, moe]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= shape.num_experts):
        raise RoutingError(f"{where}: routed expert ids in [{int(ids.min())}, {int(ids.max())}], the model has "
                           f"{shape.num_experts} experts")
    if ids.numel() and K > 1:
        srt = ids.sort(-1).values
        if bool((srt[..., 1:] == srt[..., :-1]).any()):
            raise RoutingError(f"{where}: a token is routed to the same expert twice in one layer")
    return table.to(DTYPE)


def run_routing_shape(return_routed_experts: bool, model) -> Optional[RoutingShape]:
    """The policy's routing shape when ``rollout.return_routed_experts`` is on (None: off); a
    ConfigError naming the key for a dense model. ``model``: the ``model`` section."""
    if not return_routed_experts:
        return None
    from megaforge.hf import hf_config  # lazy: transformers, for callers that never turn routing on

    hf = hf_config(model)
    try:
        shape = routing_shape(hf)
    except RoutingError as e:
        raise ConfigError(f"config key 'rollout.return_routed_experts': {e}") from None
    if shape is None:
        raise ConfigError(f"config key 'rollout.return_routed_experts': the model ({model.path or model.config}, "
                          f"model_type {getattr(hf, 'model_type', '?')!r}) has no mixture-of-experts layers: there is "
                          "no routing to return")
    return shape
