"""Our estimate of the fastest a colocated GRPO step of a given batch could run on one GPU: the train
phase at a fraction of the GPU's bf16 peak, decoding at the memory-bandwidth bound (issue 38 point 5:
"put your own estimate of the limit beside the figure"). tools/bench/bench_grpo_step.py prints it beside
its measured tokens/s.

For rows r with prompt p_r and response o_r tokens (n = sum p_r + o_r), model FLOPs F(docs) of a
forward + backward (raw_megatron.flops: 6 P n + 6 L q sum len^2), a GPU of peak C FLOP/s at the
fraction ``frac`` and memory bandwidth B bytes/s:

    train_s   = F(rows) / (frac C)                                  forward + backward of every row
    forward_s = passes F(rows) / 3 / (frac C)                       pi_old / reference forwards (1/3 of F)
    prefill_s = F(distinct prompts) / 3 / (frac C)                  one prefill per prompt (shared prefix)
    decode_s  = [max_r o_r W + kv sum_r (o_r p_r + o_r (o_r - 1) / 2)] / B
    limit tokens/s = n / (train_s + forward_s + prefill_s + decode_s)

where decode reads all weights once per step (W = 2 bytes x all parameters, bf16; every expert of a
mixture at RL batch sizes) for as many steps as the longest response (all rows in one batch), plus each
live row's K/V cache (kv = 2 L kv_heads head_dim x 2 bytes a token). Not counted: sampling, the
weight sync and memory choreography, host work: what is left is the work the hardware must do, each
phase at its own bound, one after the other.
"""
from __future__ import annotations

from raw_megatron import flops, n_params

# bf16 dense peak FLOP/s and HBM bytes/s by device name (NVIDIA's data sheets, SXM parts)
HARDWARE = {"H200": (989.4e12, 4.8e12), "H100 80GB HBM3": (989.4e12, 3.35e12)}


def hardware(device_name: str):
    """(peak bf16 FLOP/s, memory bytes/s) of a device whose name contains a key of HARDWARE, else None."""
    for key, v in HARDWARE.items():
        if key in device_name:
            return v
    return None


def step_limit(hf, prompts: list[int], responses: list[int], group: int, passes: int, peak: float,
               bandwidth: float, frac: float = 0.5) -> dict:
    """The estimate of the module doc for rows of ``prompts`` / ``responses`` tokens (the batch's
    order, each prompt's ``group`` samples adjacent), ``passes`` forward-only passes of the trainer."""
    if len(prompts) != len(responses) or not prompts or group < 1:
        raise ValueError(f"step_limit: {len(prompts)} prompts, {len(responses)} responses, group {group}")
    rows = [p + o for p, o in zip(prompts, responses)]
    rate = frac * peak
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv = 2 * hf.num_hidden_layers * hf.num_key_value_heads * hd * 2
    weights = 2 * n_params(hf, active=False)
    decode_bytes = max(responses) * weights + kv * sum(o * p + o * (o - 1) // 2 for p, o in zip(prompts, responses))
    t = {"train_s": flops(hf, rows) / rate,
         "forward_s": passes * flops(hf, rows) / 3 / rate,
         "prefill_s": flops(hf, prompts[::group]) / 3 / rate,
         "decode_s": decode_bytes / bandwidth}
    total = sum(t.values())
    out = {k: float(f"{v:.4g}") for k, v in t.items()}  # 4 significant digits: a tiny model's are microseconds
    out.update(tokens=sum(rows), seconds=float(f"{total:.4g}"), tokens_per_s=float(f"{sum(rows) / total:.4g}"),
               peak_flops=peak, bandwidth_bytes_s=bandwidth, frac_of_peak=frac, forward_passes=passes)
    return out
