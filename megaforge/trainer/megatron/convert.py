"""Offline checkpoint conversion, run by every rank of a (gloo or NCCL) world: HF directory ->
Megatron dist checkpoint at a layout, and Megatron dist checkpoint (any layout) -> HF directory.
The CLIs are ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``.

Both directions build the GPTModel at the requested layout (TP x PP x EP, expert-TP; context
parallel 1; the remaining ranks are data-parallel replicas) without random initialisation, so each
rank holds only its shards:

* :func:`hf_to_megatron`: every rank checks the HF tensors of its rows (present, shape and dtype
  as the config implies; shard files present; no HF tensor the family does not use), reads only
  those (lazily, from safetensors), and the world writes a ``torch_dist`` checkpoint plus
  ``hf_config/`` and ``megaforge_trainer.json`` (weights only: no optimizer, no schedule) that the
  megatron backend's ``load`` accepts at any layout.
* :func:`megatron_to_hf`: checks the checkpoint against the model of the HF config
  (:func:`megaforge.trainer.megatron.checkpoint.check_model_against`), loads the weights (resharding
  from the saved layout), and streams them through the bucket iterator into an HF directory
  written by rank 0 (:class:`megaforge.convert.hf_writer.HFWriter`).

Dtype: HF -> Megatron keeps the HF tensors' dtype (``dtype`` casts); Megatron -> HF keeps the
checkpoint's (``dtype`` casts on export). Bit-exact both ways otherwise: layouts only move bytes.
Output folders are written under a temporary name in the same parent and renamed at the end;
on failure they are removed (by rank 0 here, and by the CLI's parent process after it kills the
ranks, see :mod:`megaforge.convert.ranks`).
"""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from megaforge.checkpoint import check_loadable
from megaforge.convert import families
from megaforge.convert.hf_writer import DEFAULT_MAX_SHARD_BYTES, make_tmp_dir
from megaforge.convert.mapping import HFSource, hf_shapes
from megaforge.convert.ranks import Layout
from megaforge.trainer.megatron import checkpoint as mckpt
from megaforge.trainer.megatron import cpu_compat, parallel
from megaforge.trainer.megatron import model as mmodel
from megaforge.trainer.megatron.hf_export import export_hf


def setup(layout: Layout, device: str = "cpu", seed: int = 0) -> torch.device:
    """Process group (torchrun's environment) and megatron's parallel state for ``layout``."""
    from megatron.core import tensor_parallel

    dev = parallel.pick_device(device)
    if dev.type == "cpu":
        cpu_compat.apply()
    parallel.init_distributed(dev)
    parallel.init_model_parallel(layout.tp, layout.pp, 1, layout.ep, layout.etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dev


def build(hf_config, layout: Layout, dtype: torch.dtype, device: torch.device, spec: str = "torch"):
    """This rank's part of the GPTModel of ``hf_config`` at ``layout``, uninitialised (every
    parameter is loaded afterwards)."""
    family = families.family_of(hf_config)
    desc = family.describe(hf_config)
    tcfg = SimpleNamespace(tensor_parallel=layout.tp, pipeline_parallel=layout.pp, context_parallel=1,
                           expert_parallel=layout.ep, expert_tensor_parallel=layout.etp, sequence_parallel=False,
                           fp8=None, fp8_recipe="delayed", recompute="none")
    tconfig = mmodel.transformer_config(desc, tcfg, dtype, device.type == "cpu", spec)
    tconfig.perform_initialization = False
    return mmodel.build_model(desc, family, tconfig, spec, device)


def _fail_together(errors: list[str], what: str) -> None:
    """All-gather every rank's findings; raise the same ValueError on every rank if any."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)
    found = sorted({e for errs in everyone for e in errs})
    if found:
        more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
        raise ValueError(f"{what} ({len(found)} problems):\n  " + "\n  ".join(found[:20]) + more)


def check_hf_source(bm, source: HFSource, allow_cast: bool) -> None:
    """Collective: every HF tensor this rank needs exists with the shape the config implies (and
    the model's dtype unless ``allow_cast``); rank 0 also checks the shard files and that the
    directory holds no tensor the family does not map."""
    errors = []
    params = dict(bm.model.named_parameters())
    for name, pm in mmodel.local_param_maps(bm).items():
        n = mmodel.shard_group(pm)[0]
        for hn, want in zip(pm.hf, hf_shapes(pm, params[name].shape, n, bm.dims)):
            try:
                shape, dt = source.meta(hn)
            except (KeyError, FileNotFoundError) as e:
                errors.append(str(e).strip("'\""))
                continue
            if tuple(shape) != tuple(want):
                errors.append(f"HF tensor {hn}: shape {tuple(shape)} in {source.path}, the config implies "
                              f"{tuple(want)} (Megatron {pm.megatron})")
            elif dt != params[name].dtype and not allow_cast:
                errors.append(f"HF tensor {hn}: dtype {dt}, the model is {params[name].dtype} "
                              "(pass --dtype to convert on purpose)")
    if dist.get_rank() == 0:
        for f, names in sorted(source.missing_files().items()):
            errors.append(f"missing HF shard {f} (listed in the index for {len(names)} tensors: "
                          f"{', '.join(sorted(names)[:4])}{' ...' if len(names) > 4 else ''})")
        used = {h for pm in bm.family.param_maps(bm.desc) for h in pm.hf}
        ignorable = {"lm_head.weight"} if bm.desc.tied else set()
        extra = sorted(n for n in source.names()
                       if n not in used and n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
        if extra:
            errors.append(f"HF tensors that family {bm.family.name} (model_type {bm.desc.family}) does not map — "
                          f"a checkpoint of another family or config? {extra[:6]}{' ...' if len(extra) > 6 else ''}")
    _fail_together(errors, f"{source.path} does not match its config")


def _shared_tmp(out: str) -> str:
    """A temporary folder next to ``out``, created by rank 0, its path broadcast to all ranks."""
    out = os.path.abspath(out.rstrip("/"))
    box = [None]
    if dist.get_rank() == 0:
        parent, name = os.path.split(out)
        os.makedirs(parent, exist_ok=True)
        box[0] = make_tmp_dir(parent, f".{name}.tmp-")
    dist.broadcast_object_list(box, src=0)
    return box[0]


def hf_to_megatron(hf_dir: str, out: str, layout: Layout, dtype: Optional[torch.dtype] = None,
                   device: str = "cpu", spec: str = "torch", overwrite: bool = False) -> None:
    """Collective: HF directory -> weights-only dist checkpoint in ``out`` (see module doc)."""
    from transformers import AutoConfig

    out = os.path.abspath(out.rstrip("/"))
    if not overwrite and os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    dev = setup(layout, device)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    source = HFSource(path=hf_dir)
    embed = families.EMBED[1][0]
    model_dtype = dtype or (source.meta(embed)[1] if embed in source.names() else torch.float32)
    bm = build(hf_config, layout, model_dtype, dev, spec)
    check_hf_source(bm, source, allow_cast=dtype is not None)
    mmodel.load_weights(bm, source)
    tmp = _shared_tmp(out)
    try:
        meta = {"version": 0, "sched": None, "optimizer": False, "ref": False, "layout": mckpt.layout_of(),
                "family": bm.family.name, "layer_spec": spec, "dtype": str(model_dtype).removeprefix("torch."),
                "source": os.path.abspath(hf_dir)}
        hf_config.dtype = model_dtype
        mckpt.write_sharded({"model": mckpt.model_sharded_state_dict(bm)}, tmp, meta, hf_config, None, hf_dir)
        if dist.get_rank() == 0:
            if os.path.exists(out):
                shutil.rmtree(out)
            os.replace(tmp, out)
        dist.barrier()
    except BaseException:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_hf_config(ckpt: str, hf_config_dir: Optional[str]):
    """(HF config, folder with generation config / tokenizer files) for checkpoint ``ckpt``:
    ``hf_config_dir`` when given, else the checkpoint's own ``hf_config/``."""
    from transformers import AutoConfig

    d = hf_config_dir or os.path.join(ckpt, mckpt.HF_CONFIG_DIR)
    if not os.path.exists(os.path.join(d, "config.json")):
        raise FileNotFoundError(
            f"no HF config: {d}/config.json is missing (checkpoints written before hf_config/ was saved "
            "need --hf-config DIR, e.g. the model the run started from)")
    return AutoConfig.from_pretrained(d), d


def saved_dtype(ckpt: str, meta: dict) -> torch.dtype:
    if meta.get("dtype"):
        return getattr(torch, meta["dtype"])
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return load_tensors_metadata(ckpt)["embedding.word_embeddings.weight"].dtype


def saved_layout(meta: dict) -> Layout:
    lay = meta.get("layout", {})
    tp = int(lay.get("tensor_parallel", 1))
    return Layout(tp, int(lay.get("pipeline_parallel", 1)), int(lay.get("expert_parallel", 1)),
                  int(lay.get("expert_tensor_parallel", tp)))


def megatron_to_hf(ckpt: str, out: str, hf_config_dir: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                   layout: Optional[Layout] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   bucket_bytes: int = 512 << 20, device: str = "cpu", spec: str = "torch",
                   overwrite: bool = False) -> None:
    """Collective: dist checkpoint (training run or converter) -> HF directory ``out``."""
    ckpt = os.path.abspath(ckpt.rstrip("/"))
    out = os.path.abspath(out.rstrip("/"))
    if not overwrite and os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    bm, hf_config, cfg_dir = open_checkpoint(ckpt, hf_config_dir, layout, device, spec)
    export_hf(bm, hf_config, out, None, cfg_dir, max_shard_bytes, bucket_bytes, dtype, overwrite=True)


def open_checkpoint(ckpt: str, hf_config_dir: Optional[str] = None, layout: Optional[Layout] = None,
                    device: str = "cpu", spec: str = "torch"):
    """Collective: (this rank's model holding the checkpoint's weights at ``layout`` — default:
    as saved —, HF config, its folder). Checks family, shapes and shard files first, and refuses
    pickles other than tensors / checkpoint metadata (:func:`megaforge.checkpoint.check_loadable`:
    megatron-core reads ``common.pt`` without ``weights_only``)."""
    meta = mckpt.read_meta(ckpt)
    if meta.get("lora") is not None:
        raise ValueError(f"{ckpt} is a LoRA checkpoint (model.lora): it holds the adapters of the base "
                         f"{meta['lora']['base'] or '(model.path)'} and their optimizer state, not a model; use the run's "
                         "PEFT adapter folder (<run>/adapter/step_N) on that base, or its merged export (--export_hf_every)")
    check_loadable(ckpt)
    hf_config, cfg_dir = resolve_hf_config(ckpt, hf_config_dir)
    family = families.family_of(hf_config)
    if family.name != meta["family"]:
        raise ValueError(f"{ckpt} holds a {meta['family']!r} model; the HF config in {cfg_dir} is model_type "
                         f"{hf_config.model_type!r} (family {family.name!r})")
    layout = layout or saved_layout(meta)
    dev = setup(layout, device)
    bm = build(hf_config, layout, saved_dtype(ckpt, meta), dev, spec)
    mckpt.load_model(bm, ckpt, meta.get("layer_spec", "torch"))
    return bm, hf_config, cfg_dir
