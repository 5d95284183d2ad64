"""Checkpoints, PEFT export and adapter sync of the Megatron backend's LoRA (:mod:`.lora`).

A LoRA checkpoint is a torch_dist dist-checkpoint (:func:`megaforge.trainer.megatron.checkpoint.
write_sharded`) of the adapters alone, keyed by their PEFT names with their full HF shapes
(:mod:`megaforge.convert.lora_names`: e.g. ``base_model.model.model.layers.3.self_attn.q_proj.
lora_B.weight`` [nq d, r]), plus megatron's optimizer state of those parameters only (Adam moments,
fp32 main copies; the distributed optimizer's ``fully_reshardable`` format) and, after a LoRA warm
start, the reference's adapters (``ref.`` + PEFT name). ``megaforge_trainer.json`` records
``"lora": {base, rank, alpha, dropout, target_modules, reference}``: ``base`` is ``model.path`` of
the run (the frozen base is not saved; the run that resumes loads the same base). The keys do not
depend on the layout, so a checkpoint of one TP x PP x DP layout loads at any other (dist-checkpointing
reshards, the optimizer state included).

The adapter folder (``<run>/adapter/step_N``, the torch backend's layout) holds the gathered adapters
under the same PEFT names (:func:`megaforge.trainer.lora.write_adapter_folder`).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megaforge.convert.hf_writer import atomic_output_dir
from megaforge.sync.adapters import pair_buckets
from megaforge.trainer.lora import write_adapter_folder
from megaforge.trainer.megatron.checkpoint import (_OPT_METADATA, _STRATEGY, layout_of, load_optimizer, optimizer_sharded,
                                                   read_meta, write_sharded)

REF = "ref."


def _lora_meta(tr) -> dict:
    lc = tr.cfg.model.lora
    reference = None if not tr._lora_ref else ("adapters" if tr._ref_adapters is not None else "base")
    return {"base": os.path.abspath(tr.cfg.model.path) if tr.cfg.model.path else "", "rank": lc.rank,
            "alpha": lc.alpha, "dropout": lc.dropout, "target_modules": list(lc.target_modules), "reference": reference}


def _sharded(tr, with_optimizer: bool, reference, loading: bool) -> dict:
    md = dict(_OPT_METADATA)  # fresh: megatron caches the DP group in it
    model_sd = tr.lora.sharded_state_dict()
    sd = {"model": model_sd}
    if with_optimizer:
        sd["optimizer"] = optimizer_sharded(tr.optimizer, model_sd, md, loading)
    if reference == "adapters":
        tensors = tr._ref_adapters if not loading else {n: torch.empty_like(p) for n, p in tr.lora.params.items()}
        sd["ref"] = tr.lora.sharded_state_dict(REF, tensors)
    return sd


def save(tr, path: str) -> None:
    """Collective save of the adapters (and their optimizer state, the reference's adapters) into ``path``."""
    with_opt = bool(tr.cfg.checkpoint.save_optimizer)
    lm = _lora_meta(tr)
    meta = {"version": tr.version, "sched": tr.sched, "optimizer": with_opt, "ref": False, "critic": False,
            "critic_steps": 0, "layout": layout_of(), "family": tr.family.name, "layer_spec": tr.spec,
            "dtype": str(tr.dtype).removeprefix("torch."), "lora": lm}
    write_sharded(_sharded(tr, with_opt, lm["reference"], loading=False), path, meta, tr.hf_config, tr.tokenizer,
                  tr.cfg.model.path)


def load(tr, path: str) -> None:
    """Collective load of :func:`save`'s checkpoint at the current layout (any saved layout)."""
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    lm = meta.get("lora")
    if lm is None:
        raise RuntimeError(f"{path}: the checkpoint holds full weights but model.lora is set: resume with the "
                           "model.lora of the run that wrote it")
    if meta["family"] != tr.family.name:
        raise ValueError(f"{path}: checkpoint of family {meta['family']!r}, trainer is {tr.family.name!r}")
    lc = tr.cfg.model.lora
    for key, want in (("rank", lc.rank), ("target_modules", list(lc.target_modules))):
        if lm[key] != want:
            raise ValueError(f"{path}: LoRA adapters of model.lora.{key} {lm[key]!r}, the config has {want!r}")
    state = dist_checkpointing.load(_sharded(tr, meta["optimizer"], lm["reference"], loading=True), path,
                                    sharded_strategy=_STRATEGY)
    tr.lora.load_local_state({r.megatron: state["model"][r.peft] for r in tr.lora.rows})
    if meta["optimizer"]:
        load_optimizer(tr.optimizer, state["optimizer"])
    else:
        tr.optimizer.reload_model_params()  # main copies from the loaded adapters
    tr._lora_ref = lm["reference"] is not None
    tr._ref_adapters = ({r.megatron: state["ref"][REF + r.peft].clone() for r in tr.lora.rows}
                        if lm["reference"] == "adapters" else None)
    tr.version = int(meta["version"])
    if meta["sched"] is not None:
        tr.sched = dict(meta["sched"])


def export_adapter(tr, path: str) -> None:
    """The adapters as a PEFT adapter folder written by global rank 0 (atomically). Collective."""
    state = tr.lora.peft_state()
    if dist.get_rank() == 0:
        with atomic_output_dir(path) as tmp:
            write_adapter_folder(tmp, state, tr.cfg.model.lora, tr.cfg.model.path)
    dist.barrier()


def adapter_buckets(tr, max_bytes: int):
    """``sync.lora_adapters``: the full adapters as ``[(M.lora_A.weight, A), (M.lora_B.weight, B)]``
    buckets on global rank 0 (none elsewhere). Collective: every rank iterates it."""
    pairs = list(tr.lora.adapter_pairs())
    if tr.is_engine_feeder:
        yield from pair_buckets(pairs, max_bytes)
