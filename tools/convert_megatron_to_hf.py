"""Convert a Megatron dist checkpoint (torch_dist, any layout) into a Hugging Face directory.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--hf-config DIR] [--dtype bf16]
    python tools/convert_megatron_to_hf.py --ckpt RUN/checkpoints/step_000100/trainer --out DIR
    torchrun --nproc_per_node N tools/convert_megatron_to_hf.py --ckpt DIR --out DIR --tp 2 --pp 2

``--ckpt`` is a checkpoint of ``tools/convert_hf_to_megatron.py`` or the ``trainer/`` folder of a
training run's checkpoint (optimizer and reference model are ignored). The HF config, generation
config and tokenizer come from the checkpoint's ``hf_config/`` or ``--hf-config DIR``. The weights
are loaded at the layout they were saved at (from ``megaforge_trainer.json``), or at ``--tp/--pp/
--ep/--etp`` (megatron reshards on load; ``--tp 1 --pp 1`` uses one process holding the whole
model). Without torchrun the tool spawns that many ranks itself (CPU / gloo unless ``--device
cuda``). Global rank 0 receives the tensors bucket by bucket and writes ``model-0000i-of-0000N.
safetensors`` + ``model.safetensors.index.json`` (or one ``model.safetensors``) with shards of at
most ``--max-shard-size`` (transformers' format), ``config.json`` (dtype set), ``generation_config.
json`` and the tokenizer files. The dtype of the checkpoint is kept unless ``--dtype``.

Errors — a checkpoint of another family, a tensor whose shape differs from what the config implies,
a missing shard file — name the tensor and both shapes; on failure nothing is left under ``--out``
(a temporary folder next to it is renamed at the end, removed otherwise).
"""
from __future__ import annotations

import argparse
import os
import sys

from megaforge.convert.ranks import DTYPES


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="Megatron dist checkpoint directory")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--hf-config", "--hf_config", dest="hf_config", default=None,
                   help="HF config / tokenizer directory (default: the checkpoint's hf_config/)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights (default: keep)")
    p.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default="5GB",
                   help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (a bigger single tensor gets its own)")
    p.add_argument("--bucket-size", "--bucket_size", dest="bucket_size", default="512MiB",
                   help="largest bucket streamed to rank 0 at a time")
    for k, h in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"), ("etp", "expert tensor")):
        p.add_argument(f"--{k}", type=int, default=None, help=f"{h} parallel size to load at (default: as saved)")
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p.parse_args(argv)


def layout(args):
    """The load layout: --tp/--pp/--ep/--etp over the saved one."""
    from megaforge.convert.ranks import Layout

    import json

    saved = {}
    meta = os.path.join(args.ckpt, "megaforge_trainer.json")
    if os.path.exists(meta):
        with open(meta) as f:
            saved = json.load(f).get("layout", {})
    tp = args.tp or int(saved.get("tensor_parallel", 1))
    if args.tp is not None and args.etp is None:
        etp = tp
    else:
        etp = args.etp or int(saved.get("expert_tensor_parallel", tp))
    return Layout(tp, args.pp or int(saved.get("pipeline_parallel", 1)), args.ep or int(saved.get("expert_parallel", 1)), etp)


def rank_main(args) -> None:
    from megaforge.convert.ranks import rank_done, rank_setup

    rank_setup()
    import torch

    from megaforge.convert.hf_writer import parse_size
    from megaforge.trainer.megatron.convert import megatron_to_hf

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    megatron_to_hf(args.ckpt, args.out, args.hf_config, dtype, layout(args), parse_size(args.max_shard_size),
                   parse_size(args.bucket_size), args.device, "torch", args.overwrite)
    rank_done(f"wrote {os.path.abspath(args.out)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    from megaforge.convert.ranks import in_rank, missing_checkpoint_files, remove_leftovers, spawn

    if in_rank():
        rank_main(args)
        return 0
    if not os.path.exists(os.path.join(args.ckpt, "megaforge_trainer.json")):
        print(f"error: {os.path.abspath(args.ckpt)}/megaforge_trainer.json is missing: not a complete megaforge "
              "megatron checkpoint", file=sys.stderr)
        return 2
    if not args.overwrite and os.path.isdir(args.out) and os.listdir(args.out):
        print(f"error: {os.path.abspath(args.out)} exists and is not empty (pass --overwrite)", file=sys.stderr)
        return 2
    from megaforge.checkpoint import CheckpointRefused, check_loadable

    try:
        check_loadable(args.ckpt)  # only tensors and checkpoint metadata in its pickles
    except CheckpointRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    missing = missing_checkpoint_files(args.ckpt)  # fail before starting any rank
    if missing:
        print(f"error: {os.path.abspath(args.ckpt)} is incomplete:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    return spawn(os.path.abspath(__file__), sys.argv[1:] if argv is None else list(argv), layout(args).world(),
                 on_failure=lambda: remove_leftovers(args.out))


if __name__ == "__main__":
    sys.exit(main())
