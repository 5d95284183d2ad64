#!/usr/bin/env python
"""Parse the mapped flags (tools/peers/mapping.py slime) with slime's own ``parse_args`` (Megatron-LM's parser with
slime's arguments, SGLang's ServerArgs, sglang_router's RouterArgs, then slime's, Megatron's and SGLang's checks,
including slime's check of the flags against the HF config.json), before any GPU time is spent. No GPU.
Megatron's parser ignores flags it does not know (slime parses with ignore_unknown_args): every option string the
parsers register is recorded, and a flag none registered is refused here.

    python tools/peers/mapping.py slime --config configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml --steps 20 \
        --data_dir D --out_dir O --model.path configs/models/qwen2.5-coder-0.5b > slime.args
    PYTHONPATH=$PWD:$PWD/tools/peers:SLIME:MEGATRON_LM:SITE... python tools/peers/slime_check.py slime.args

Needs slime's source (THUDM/slime), its Megatron-LM (patched), its SGLang (0.5.15.post1, patched), sglang_router,
ray and wandb importable (tools/peers/NEXT.md, B: the environment this ran in). Prints the values that matter as
one JSON line and ``parsed``; a flag slime refuses is one ``megaforge: error:`` line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys

SHOW = ["num_rollout", "rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "use_dynamic_batch_size",
        "max_tokens_per_gpu", "lr", "weight_decay", "adam_beta2", "clip_grad", "eps_clip", "eps_clip_high",
        "advantage_estimator", "grpo_std_normalization", "calculate_per_token_loss", "use_kl_loss", "kl_coef",
        "rollout_temperature", "rollout_max_response_len", "rollout_max_prompt_len", "colocate", "offload_train",
        "offload_rollout", "sglang_mem_fraction_static", "sglang_attention_backend", "sglang_sampling_backend",
        "sglang_cuda_graph_bs_decode", "sglang_cuda_graph_backend_prefill", "transformer_impl", "attention_backend",
        "bf16", "use_distributed_optimizer", "gradient_accumulation_fusion", "untie_embeddings_and_output_weights",
        "custom_rm_path", "seed", "save_hf"]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) if argv[0] != "-" else sys.stdin as f:
        flags = f.read().split()
    sys.argv = ["train.py", *flags]
    try:
        from slime.utils.arguments import parse_args
    except ImportError as e:
        print(f"megaforge: error: slime is not importable here: {e}", file=sys.stderr)
        return 2
    known: set[str] = set()  # every option string the parsers register (Megatron's parser ignores unknown flags)
    add = argparse._ActionsContainer.add_argument

    def recording_add(self, *a, **kw):
        action = add(self, *a, **kw)
        known.update(action.option_strings)
        return action

    argparse._ActionsContainer.add_argument = recording_add
    try:
        args = parse_args()
    except (AssertionError, ValueError, SystemExit) as e:
        print(f"megaforge: error: slime refuses the flags: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        argparse._ActionsContainer.add_argument = add
    unknown = [x for x in flags if x.startswith("--") and x not in known]
    if unknown:
        print(f"megaforge: error: slime's parsers ignore flags they do not know: {' '.join(unknown)}", file=sys.stderr)
        return 2
    print(json.dumps({k: str(getattr(args, k, "<absent>")) for k in SHOW}))
    print("parsed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
