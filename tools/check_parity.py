"""Compare megaforge's Megatron backend with Hugging Face transformers on one random token batch.

    torchrun --nproc_per_node N tools/check_parity.py --hf DIR --tp 2 --pp 1 --cp 1 [--tol 1e-4]
    torchrun --nproc_per_node 4 tools/check_parity.py --hf MOE_DIR --ep 2 --etp 2   # mixture of experts

Every rank builds the Megatron model at the given layout from the HF directory; global rank 0 also
runs the HF model (transformers, same dtype, each row unpadded). Prints one JSON line (rank 0):
``max_abs_logprob_diff``, ``mean_abs_logprob_diff``, ``argmax_agreement`` (fraction of predicted
positions where both models' most likely next token agree), the layout, and ``ok``. Exits 1 when
the max difference exceeds ``--tol`` (default 1e-4, meant for float32; bf16 needs ~1e-1).
Run it before long jobs, and after adding a model family.
"""
from __future__ import annotations

import argparse
import sys

import torch

from common import emit, rl_batch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="Hugging Face model directory")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE; trainer.expert_parallel)")
    p.add_argument("--etp", type=int, default=1,
                   help="expert tensor parallelism (MoE; trainer.expert_tensor_parallel)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--tol", type=float, default=1e-4, help="max allowed |logprob difference|")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layer_spec", default="auto", choices=["auto", "te", "torch"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--batch", type=int, default=4, help="rows (lengths spread over [seq/4, seq])")
    p.add_argument("--seq", type=int, default=64, help="longest row")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def random_batch(vocab: int, rows: int, seq: int, seed: int):
    """``rows`` rows of random tokens, lengths spread evenly over [seq/4, seq], no loss positions."""
    lengths = torch.linspace(max(2, seq // 4), seq, rows).round().long()
    return rl_batch(lengths, vocab, prompt_lens=lengths, width=seq, seed=seed)


def hf_rows(path: str, batch, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, argmax) [B, T] of the transformers model, token-aligned."""
    import transformers

    from megaforge.trainer.logprobs import token_logprobs

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    lp = torch.zeros(batch.tokens.shape)
    am = torch.zeros(batch.tokens.shape, dtype=torch.long)
    with torch.no_grad():
        for b in range(batch.batch_size):
            n = int(batch.lengths[b])
            tok = batch.tokens[b:b + 1, :n].to(device)
            logits = model(tok).logits
            lp[b, :n] = token_logprobs(logits, tok, batch.lengths[b:b + 1].to(device))[0][0].cpu()
            am[b, 1:n] = logits[0, :-1].argmax(-1).cpu()
    return lp, am


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from megaforge.config import config_from_dict
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    cfg = config_from_dict({
        "model": {"path": args.hf, "dtype": args.dtype},
        "trainer": {"backend": "megatron", "device": args.device, "tensor_parallel": args.tp,
                    "pipeline_parallel": args.pp, "context_parallel": args.cp, "sequence_parallel": args.sp,
                    "expert_parallel": args.ep, "expert_tensor_parallel": args.etp,
                    "layer_spec": args.layer_spec, "micro_batch_size": args.batch},
        "grpo": {"temperature": 1.0}, "max_steps": 0, "seed": args.seed,
    })
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    batch = random_batch(tr.desc.vocab, args.batch, args.seq, args.seed)
    mg = tr.forward_rows(batch, "policy", ("logprobs", "argmax"))
    ok = True
    if dist.get_rank() == 0:
        lp, am = hf_rows(args.hf, batch, tr.dtype, tr.device)
        t = torch.arange(batch.tokens.shape[1])[None]
        valid = (t >= 1) & (t < batch.lengths[:, None])
        diff = (mg["logprobs"] - lp).abs()[valid]
        report = {
            "max_abs_logprob_diff": float(diff.max()), "mean_abs_logprob_diff": float(diff.mean()),
            "argmax_agreement": float((mg["argmax"] == am)[valid].float().mean()), "tokens": int(valid.sum()),
            "tp": args.tp, "pp": args.pp, "cp": args.cp, "sp": args.sp, "ep": args.ep, "etp": args.etp,
            "dtype": args.dtype,
            "layer_spec": tr.spec, "family": tr.family.name, "world_size": dist.get_world_size(), "tol": args.tol,
        }
        ok = report["max_abs_logprob_diff"] <= args.tol
        report["ok"] = ok
        emit(report, tr.device)
    box = [ok]
    dist.broadcast_object_list(box, src=0)
    tr.close()
    dist.destroy_process_group()
    return 0 if box[0] else 1


if __name__ == "__main__":
    sys.exit(main())
