"""The policy forward of the torch backend: an HF CausalLM's token log-probs (and entropy), with the
LM head run at every position or only at the trained ones.

``positions="all"``: ``lm(...).logits`` [B, T, V], then :func:`~megaforge.trainer.logprobs.token_logprobs`
(every position 1 <= t < length). ``positions="trained"``: the decoder alone,

    h [B, T, C] = lm.get_decoder()(tokens).last_hidden_state
    rows, cols  = positions (b, t) with loss_mask[b, t] > 0, 1 <= t < length          [N] each
    logits      = lm_head(h[rows, cols - 1])                                         [N, V]

then :func:`~megaforge.trainer.logprobs.selected_token_logprobs`: the same values at those positions
(position t's logprob is of token t given tokens < t: the hidden state at t - 1), 0 elsewhere. The
head costs 2 C V FLOP per position (x3 with its backward) and a [positions, V] float32 buffer, so a
GSM8K row of ~150 prompt and ~280 response tokens pays it on its response only. This equals the
CausalLM's forward only where that forward is exactly ``lm_head(decoder(...).last_hidden_state)``
(no logit scaling or soft-capping): the model types registered with ``split_head`` in
:mod:`megaforge.model_families`, checked by :func:`check_split_head`.

Under ``trainer.autocast`` the decoder runs in bfloat16 and the head in float32
(:func:`megaforge.trainer.precision.float32_head` patches the head module, used either way); the
log-softmax runs after the autocast context, in float32.
"""
from __future__ import annotations

from typing import Optional

import torch

from megaforge.model_families import model_types
from megaforge.trainer import precision
from megaforge.trainer.logprobs import selected_token_logprobs, token_logprobs, trained_positions

POSITIONS = ("all", "trained")


def check_split_head(lm) -> None:
    """ValueError unless ``lm``'s logits are its head applied to its decoder's last hidden state."""
    mt = getattr(lm.config, "model_type", None)
    split = model_types(split_head=True)  # the families whose CausalLM forward is lm_head(decoder(...)) alone
    if mt not in split:
        raise ValueError(
            f"trainer.head_positions: 'trained' runs the decoder and the LM head separately, which equals the "
            f"CausalLM forward for model types {', '.join(split)}; this model is {mt!r} "
            f"({type(lm).__name__}): set trainer.head_positions: all")
    decoder = lm.get_decoder()
    if decoder is lm or not isinstance(lm.get_output_embeddings(), torch.nn.Linear):
        raise ValueError(f"trainer.head_positions: {type(lm).__name__} has no separate decoder and linear "
                         f"LM head; set trainer.head_positions: all")


def causal_lm_logprobs(lm, tokens: torch.Tensor, lengths: torch.Tensor, temperature: float, with_entropy: bool,
                       autocast: str, loss_mask: Optional[torch.Tensor] = None,
                       position_ids: Optional[torch.Tensor] = None, positions=None):
    """(logprobs [B, T], entropy [B, T] or None) of ``lm`` on right-padded ``tokens`` [B, T]: at every
    position 1 <= t < length when ``loss_mask`` and ``positions`` are None, else only at positions with
    loss_mask > 0 (0 elsewhere; see the module docstring). ``positions``: their (rows [N], cols [N]) of
    :func:`~megaforge.trainer.logprobs.trained_positions`, computed by the caller on the host (on the
    device, ``nonzero`` would make the host wait for it); else computed here from ``loss_mask``.
    ``position_ids`` [B, T] (packed rows): no attention mask, the model derives the per-row causal
    mask from the restarts."""
    if positions is None and loss_mask is not None:
        positions = trained_positions(loss_mask, lengths)
    T = tokens.shape[1]
    attn = None
    if position_ids is None:
        attn = (torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]).long()
    kw = dict(input_ids=tokens, attention_mask=attn, position_ids=position_ids, use_cache=False)
    with precision.autocast(autocast, tokens.device):
        if positions is None:
            logits = lm(**kw).logits
        else:
            rows, cols = (p.to(tokens.device, non_blocking=True) for p in positions)
            h = lm.get_decoder()(**kw).last_hidden_state
            logits = lm.get_output_embeddings()(h[rows, cols - 1])
    if positions is None:
        return token_logprobs(logits, tokens, lengths, temperature, with_entropy)
    return selected_token_logprobs(logits, tokens, rows, cols, temperature, with_entropy)


class CausalLMLogprobs(torch.nn.Module):
    """:func:`causal_lm_logprobs` of ``lm`` as a module's forward, so that DDP wraps one forward whose
    backward it reduces (the decoder and the head called separately would bypass DDP's forward).
    Its parameters are ``lm``'s (under the prefix ``lm.``); ``lm`` keeps its own names."""

    def __init__(self, lm: torch.nn.Module, autocast: str):
        super().__init__()
        self.lm = lm
        self.autocast = autocast

    def forward(self, tokens, lengths, temperature: float, with_entropy: bool, loss_mask=None, position_ids=None,
                positions=None):
        return causal_lm_logprobs(self.lm, tokens, lengths, temperature, with_entropy, self.autocast,
                                  loss_mask, position_ids, positions)
