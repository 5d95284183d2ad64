"""Convert a Hugging Face model directory into a Megatron dist checkpoint (torch_dist) at a layout.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp 2 --pp 2 [--ep 2] [--etp 1]
    torchrun --nproc_per_node N tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp 2 --pp 2

Without torchrun the tool spawns the ranks itself: PP x lcm(TP, ETP x EP) processes (ETP, the
expert tensor parallel size, defaults to TP as in megatron), on CPU with gloo by default (no GPU
needed; ``--device cuda`` uses one GPU per rank). Under torchrun any world that is a multiple of
both TP x PP and ETP x EP x PP works (the rest are data-parallel replicas). Every rank reads only
the HF tensors of its shards. Families: Llama, Qwen2, Qwen3, Qwen3-MoE (megaforge.convert.families).

The result loads into the megatron backend at any layout (``MegatronTrainer.load``, resharding as
needed) and converts back with ``tools/convert_megatron_to_hf.py``. It holds the weights only (no
optimizer), ``hf_config/`` (config, generation config, tokenizer files) and
``megaforge_trainer.json``. Weights keep the HF dtype unless ``--dtype``; bit-exact otherwise.
Errors (a tensor missing or of another shape than the config implies, a missing shard file, tensors
of another family) name the tensor and both shapes; nothing is left under ``--out`` on failure
(written to a temporary folder next to it and renamed at the end).
"""
from __future__ import annotations

import argparse
import os
import sys

from megaforge.convert.ranks import DTYPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="Hugging Face model directory (safetensors)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: keep)")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--layer_spec", default="torch", choices=["torch", "te"],
                   help="parameter naming of the checkpoint (either loads under both specs)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p.parse_args(argv)


def layout(args):
    from megaforge.convert.ranks import Layout

    return Layout(args.tp, args.pp, args.ep, args.etp)


def rank_main(args) -> None:
    from megaforge.convert.ranks import rank_done, rank_setup

    rank_setup()
    import torch

    from megaforge.trainer.megatron.convert import hf_to_megatron

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    hf_to_megatron(args.hf, args.out, layout(args), dtype, args.device, args.layer_spec, args.overwrite)
    rank_done(f"wrote {os.path.abspath(args.out)} (tp={args.tp} pp={args.pp} ep={args.ep} etp={args.etp or args.tp})")


def main(argv=None) -> int:
    args = parse_args(argv)
    from megaforge.convert.ranks import in_rank, spawn

    if in_rank():
        rank_main(args)
        return 0
    if not args.overwrite and os.path.isdir(args.out) and os.listdir(args.out):
        print(f"error: {os.path.abspath(args.out)} exists and is not empty (pass --overwrite)", file=sys.stderr)
        return 2
    from megaforge.convert.ranks import remove_leftovers

    n = layout(args).world()
    return spawn(os.path.abspath(__file__), sys.argv[1:] if argv is None else list(argv), n,
                 on_failure=lambda: remove_leftovers(args.out))


if __name__ == "__main__":
    sys.exit(main())
