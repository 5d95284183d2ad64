"""megatron-core's own pretraining step, the baseline the train benchmarks set megaforge's RL step
beside (tools/bench/bench_train.py, tools/bench/bench_grpo_step.py), and the FLOP count both are rated by.

FLOPs of a forward + backward = 6 P n + 6 L q sum_d len_d^2, with P all parameters (Llama layout:
attention, gated MLP, two norms a layer, untied embedding and output layer, final norm; a mixture of
experts counts the k experts a token is routed to, not all E), n the real tokens, q = heads x head_dim
(the hidden size h for Llama / Qwen2 shapes) and the attention term summed over documents d (a full
row of ``seq`` tokens gives the usual 6 L s h n). Model shapes are transformers configs (``hidden_size``, ``intermediate_size``, ...).
"""
from __future__ import annotations

import torch


def _moe_layers(hf) -> list:
    """Indices of a Qwen-MoE config's sparse layers (none for a dense model)."""
    if not str(getattr(hf, "model_type", "")).endswith("_moe") or not getattr(hf, "num_experts", 0):
        return []
    only, step = set(getattr(hf, "mlp_only_layers", None) or []), int(getattr(hf, "decoder_sparse_step", 1) or 1)
    return [i for i in range(hf.num_hidden_layers) if i not in only and (i + 1) % step == 0]


def n_params(hf, active: bool = True) -> int:
    """Parameters of the Llama layout of config ``hf`` (head size ``head_dim``, or hidden / heads).
    Mixture of experts (Qwen-MoE): a sparse layer's MLP is its router (E h) plus k experts of
    3 h F_e each when ``active`` (what one token's forward multiplies by), all E experts otherwise."""
    h, f, L, V = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size
    heads, kv = hf.num_attention_heads, hf.num_key_value_heads
    hd = getattr(hf, "head_dim", None) or h // heads
    attn = h * hd * (heads + 2 * kv) + heads * hd * h
    moe = _moe_layers(hf)
    mlp = (L - len(moe)) * 3 * h * f
    if moe:
        k = hf.num_experts_per_tok if active else hf.num_experts
        mlp += len(moe) * (hf.num_experts * h + k * 3 * h * hf.moe_intermediate_size)
    return L * (attn + 2 * h) + mlp + 2 * V * h + h


def flops(hf, doc_lengths) -> float:
    """Forward + backward FLOPs of documents of ``doc_lengths`` tokens (formula above, with P the
    *active* parameters of a mixture of experts and the attention term over the query width
    heads x head_dim, which is h for Llama / Qwen2 shapes)."""
    n = sum(doc_lengths)
    qd = hf.num_attention_heads * (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    return 6.0 * n_params(hf) * n + 6.0 * hf.num_hidden_layers * qd * sum(x * x for x in doc_lengths)


def raw_microbatches(vocab: int, seq: int, rows: int, n_micro: int, device, seed: int = 1) -> list:
    """``n_micro`` micro-batches of ``rows`` full rows of ``seq`` random tokens: (tokens, positions,
    labels = the tokens shifted by one, each [rows, seq] on ``device``; the token count, an int32
    scalar on ``device``, made once here: a ``torch.tensor(n, device=cuda)`` in the loss function is
    a host-to-device copy that waits for the device, once per micro-batch, which megatron's
    pretraining loss (a device-side count) does not do)."""
    g = torch.Generator().manual_seed(seed)
    count = torch.tensor(rows * seq, device=device, dtype=torch.int)
    data = []
    for _ in range(n_micro):
        tok = torch.randint(0, vocab, (rows, seq + 1), generator=g)
        data.append((tok[:, :-1].to(device), torch.arange(seq, device=device)[None].expand(rows, seq).contiguous(),
                     tok[:, 1:].to(device), count))
    return data


def raw_step(tr, seq: int, rows: int, data: list) -> None:
    """megatron-core's pretraining step on the model and optimizer of MegatronTrainer ``tr``:
    ``get_forward_backward_func`` over the micro-batches ``data`` (sbhd, causal, megatron's
    vocab-parallel cross entropy summed), then the optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from torch.profiler import record_function

    def forward_step(it, model):
        tokens, pos, labels, count = next(it)
        with record_function("raw.forward"):  # bench_train's profile: host ops by stack in this range
            per_token = model(tokens, pos, None, labels=labels)  # [b, s] cross entropy (the loss inside the model)

        def loss_func(x):
            loss = x.float().sum()
            return loss, count, {"lm loss": loss.detach()}
        return per_token, loss_func

    tr.ddp.train()
    tr.ddp.zero_grad_buffer()
    tr.optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(data), model=[tr.ddp], num_microbatches=len(data),
        seq_length=seq, micro_batch_size=rows, forward_only=False)
    tr.optimizer.step()
