"""Mixed precision of the torch backend (``trainer.autocast``): the decoder under bfloat16 autocast,
the LM head and everything after it in float32.

With ``autocast: bfloat16`` and float32 parameters (``model.dtype: float32``), every matmul of the
decoder layers runs in bfloat16 (inputs cast by autocast, float32 accumulation); the residual stream
stays float32 (embedding output float32 + bfloat16 branch outputs promote to float32), RMSNorm
normalises in float32, and the gradients, AdamW moments and weights stay float32 (the master copy:
an update of lr 5e-6 is not lost to bfloat16 rounding). The LM head

    logits [N, T, V] = h [N, T, C] @ W_head^T [C, V]   in float32 (autocast off)

so token log-probs keep float32 resolution: bfloat16 logits of magnitude 16 are spaced 0.125 apart,
which would move importance ratios exp(lp - lp_old) by up to ~6%.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPES = {"bfloat16": torch.bfloat16}


#: attention kernels a training forward may use on CUDA: every SDPA backend but cuDNN's. cuDNN's
#: bfloat16 / float16 backward (the default backend on H100 / H200 since torch 2.11) returns NaN in
#: dQ when an attn_mask is passed, the sequence length is 64 mod 128 and a query row's logsumexp is
#: below ln(FLT_MAX) ~ -88.7 — which Qwen2.5's "massive activation" heads produce (pytorch/pytorch
#: #196678, huggingface/trl #7181). Measured here: GSM8K GRPO on Qwen2.5-Coder-0.5B under bfloat16
#: autocast on the H200 skipped 10 of 208 optimizer steps for a non-finite gradient with a finite
#: loss (docs/benchmarks/README.md), about one micro-batch length in 128 times 8 micro-batches.
#: The backend is chosen in the forward and its backward follows it, so the forward's context suffices.
TRAINING_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def training_attention(device: torch.device):
    """On CUDA, the SDPA backends of :data:`TRAINING_SDPA_BACKENDS` for the forwards whose backward
    runs (and those whose log-probs enter the loss); a no-op elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(TRAINING_SDPA_BACKENDS))


@contextlib.contextmanager
def autocast(mode: str, device: torch.device):
    """The context of a trainer forward (policy, reference, critic): bfloat16 autocast on ``device``
    for mode "bfloat16" (none for "off"), and on CUDA the SDPA backends of
    :data:`TRAINING_SDPA_BACKENDS` (cuDNN's attention left out: its backward can return NaN).
    Entered by ``with``, not by the call."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(training_attention(device))
        if mode != "off":
            stack.enter_context(torch.autocast(device_type=device.type, dtype=DTYPES[mode]))
        yield


def _float32_linear(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with autocast off and float32 operands: x [..., C] -> [..., V]."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias)


def float32_head(model) -> None:
    """Make ``model.lm_head`` (an HF CausalLM's) compute in float32 under autocast; the parameter and its
    name are unchanged (the bound forward replaces the instance's, not the class's)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"trainer.autocast: the model's output layer is a {type(head).__name__}, not nn.Linear")
    head.forward = types.MethodType(_float32_linear, head)
