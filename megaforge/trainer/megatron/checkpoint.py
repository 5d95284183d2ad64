"""Megatron dist-checkpointing of the trainer (``torch_dist`` format), and offload / onload.

A checkpoint directory holds the policy's sharded state, optionally the optimizer's (fully
reshardable: saved at one TP x PP x DP x EP layout, loadable at another) and the frozen reference
model, plus ``megaforge_trainer.json`` (weight version, LR-schedule position, what was saved, family,
layer spec, layout, dtype) and ``hf_config/`` (the HF ``config.json``, generation config and
tokenizer files, so ``tools/convert_megatron_to_hf.py`` needs nothing else). A *weights-only*
checkpoint (``tools/convert_hf_to_megatron.py``) has ``"sched": null`` and no optimizer / reference.

Keys are megatron's layer-stacked ShardedTensor keys (e.g. ``decoder.layers.self_attention.
linear_qkv.weight`` of global shape [L, (nq + 2 nkv) d, H]; experts ``decoder.layers.mlp.experts.
experts.linear_fc1.weight`` [L, E, 2 F_e, H]). A checkpoint written under one layer spec loads
under the other: the two norm keys that differ are renamed (:func:`model_sharded_state_dict`).
Before loading, every requested tensor is checked against the checkpoint's metadata and files
(:func:`check_model_against`), so a wrong family / shape / config or a missing shard file fails
with the tensor's name and both shapes instead of deep inside torch.distributed.checkpoint.

megatron's writer normally hands results back through a ``multiprocessing`` Manager started with
the *spawn* method, which re-imports the entry script and hangs a script without an
``if __name__ == "__main__":`` guard. Saves here are synchronous, so an in-process queue serves
the same purpose; :func:`save` installs one and no Manager process is started.

Host memory of a save (P parameters, bf16 weights + fp32 main params and Adam moments: a 14P-byte
checkpoint). megatron-core 0.16.1's fully reshardable optimizer save gathers every state into fp32
world buffers through full-size local shards and per-key copies (~32P bytes of host memory), and its
writer clones every slice of them again; its staging of device tensors goes to pinned host memory
rounded up to powers of two and kept cached. At one data-parallel rank the optimizer's own tensors
are the whole state, so the same ShardedTensors are built over them (:func:`_fully_reshardable_state_dp1`)
and the staging copy is a blocking one into ordinary memory freed after the write: ~14P of host
memory above the process's own (the H200 recipe's 24 GB checkpoint took 59 GiB before).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import queue
from typing import Optional

import torch
import torch.distributed as dist

from megaforge.convert.families import checkpoint_key_to_spec
from megaforge.convert.hf_writer import write_hf_metadata
from megaforge.convert.ranks import missing_checkpoint_files

_STRATEGY = ("torch_dist", 1)
_META = "megaforge_trainer.json"
HF_CONFIG_DIR = "hf_config"
_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                 "chained_optim_avoid_prefix": True}


def _ensure_adam_state(optimizer) -> None:
    """Materialise the Adam state a fresh optimizer creates lazily at its first ``step``, exactly as
    that step would, so megatron can describe it before any step has run: torch AdamW keeps a
    per-parameter ``step`` (0) and zero moments; Transformer Engine's FusedAdam (megatron's Adam
    whenever TE imports) keeps ``step`` per param group and builds its moments, in its configured
    dtypes, with its own ``initialize_state`` (a per-parameter ``step`` there makes its
    ``state_dict`` raise KeyError 'step', as the H200 showed on loading a TE checkpoint)."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is None:
            continue
        te_init = getattr(inner, "initialize_state", None)  # TE FusedAdam
        for group in inner.param_groups:
            for p in group["params"]:
                if not p.numel() or inner.state[p]:
                    continue
                if te_init is not None:
                    te_init(p, bool(getattr(inner, "store_param_remainders", False)) and p.dtype == torch.bfloat16)
                else:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _fully_reshardable_state_dp1(opt, model_sharded_state_dict):
    """megatron-core 0.16.1's ``DistributedOptimizer.sharded_param_state_fully_reshardable`` (save side)
    for a data-parallel group of one, without its copies: megatron gathers every state into three fp32
    world buffers (12 B/param) through full-size local shards (12 B/param) and per-key host copies
    plus a ``torch.cat`` (8 B/param), and its writer then clones every slice of those buffers again
    (``_clone_if_needed``: a view). With DP = 1 each parameter's whole state is the optimizer's own
    tensor: the same ShardedTensors (keys, shapes, fp32, replica ids), over the optimizer's tensors."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    msd, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    meta = {sh.data: sh for sh in nested_values(msd)}
    state = {}
    for buffer in opt.buffers:  # one per gbuf_ranges entry, each of one dtype (megatron asserts it)
        for model_param in buffer.param_index_map:  # megatron's order, numbered across buffers
            sh = meta[model_param]
            src = opt._get_main_param_and_optimizer_states(model_param)
            tensors = {}
            for k in ("param", "exp_avg", "exp_avg_sq"):
                ten = src[k].detach()
                if ten.numel() != model_param.numel():
                    return None  # not the whole parameter here: megatron's own path
                ten = ten.to(torch.float32).view(sh.data.shape)
                kw = dict(key=f"optimizer.state.{k}.{sh.key}", data=ten, dtype=ten.dtype, replica_id=sh.replica_id)
                if isinstance(sh, ShardedTensorFactory):
                    kw.pop("dtype")
                tensors[k] = replace(sh, **kw)
                tensors[k].validate_metadata_integrity()
            state[len(state)] = tensors
    return state


@contextlib.contextmanager
def _patched_method(cls, name: str, wrap):
    """``cls.name`` replaced by ``wrap(original)`` inside the block, the original restored after."""
    orig = getattr(cls, name)
    setattr(cls, name, wrap(orig))
    try:
        yield
    finally:
        setattr(cls, name, orig)


@contextlib.contextmanager
def _lean_fully_reshardable_save(loading: bool):
    """While saving (not ``loading``): :func:`_fully_reshardable_state_dp1` where the DP group is one
    rank (the format on disk is megatron's ``fully_reshardable``, unchanged); megatron's own gather
    otherwise."""
    if loading:
        yield
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def wrap(orig):
        def lean(self, model_sharded_state_dict, is_loading=False, metadata=None):
            if not is_loading and self.data_parallel_group.size() == 1:
                state = _fully_reshardable_state_dp1(self, model_sharded_state_dict)
                if state is not None:
                    return state
            return orig(self, model_sharded_state_dict, is_loading, metadata)
        return lean

    with _patched_method(DistributedOptimizer, "sharded_param_state_fully_reshardable", wrap):
        yield


def _sharded(tr, with_optimizer: bool, with_ref: bool, loading: bool, saved_spec: Optional[str] = None,
             with_critic: bool = False) -> dict:
    # a fresh metadata dict each time: megatron caches the current DP group in it (in place)
    md = dict(_OPT_METADATA)
    model_sd = model_sharded_state_dict(tr.bm, saved_spec, md)
    sd = {"model": model_sd}

    def optimizer_sd(optimizer, model_part: dict) -> dict:
        return optimizer_sharded(optimizer, model_part, md, loading)

    if with_optimizer:
        sd["optimizer"] = optimizer_sd(tr.optimizer, model_sd)
    if with_ref:
        sd["ref"] = tr.ref.sharded_state_dict(prefix="ref.", metadata=md)
    if with_critic:  # the PPO critic (megaforge.trainer.megatron.critic) and its optimizer
        critic_sd = tr.critic.bm.model.sharded_state_dict(prefix="critic.", metadata=md)
        sd["critic"] = critic_sd
        if with_optimizer:
            sd["critic_optimizer"] = optimizer_sd(tr.critic.optimizer, critic_sd)
    return sd


def optimizer_sharded(optimizer, model_sd: dict, md: dict, loading: bool) -> dict:
    """The optimizer's sharded state for the parameters of ``model_sd`` (megatron's, in the
    ``fully_reshardable`` format of metadata ``md`` for a distributed optimizer)."""
    _ensure_adam_state(optimizer)
    with _lean_fully_reshardable_save(loading):
        return optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=md)


def load_optimizer(optimizer, state: dict) -> None:
    """Load what :func:`optimizer_sharded` described (with the megatron-core 0.16.1 work-arounds)."""
    with _step_tolerant_reshardable_load():
        optimizer.load_state_dict(state)
    _unshare_adam_steps(optimizer)


def layout_of() -> dict:
    """The current megatron layout (written into the checkpoint metadata)."""
    from megatron.core import parallel_state as ps

    return {"tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
            "context_parallel": ps.get_context_parallel_world_size(),
            "expert_parallel": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel": ps.get_expert_tensor_parallel_world_size()}


def write_sharded(sharded_state_dict: dict, path: str, meta: dict, hf_config=None, tokenizer=None,
                  model_path: str = "") -> None:
    """Collective torch_dist save of ``sharded_state_dict`` (``{"model": ..., ["optimizer": ...,
    "ref": ...]}``, the trainer's nesting, which common.pt keeps) into ``path`` (created), then rank 0
    writes ``hf_config/`` and, last, ``megaforge_trainer.json`` (its presence marks a complete
    checkpoint)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    filesystem_async._results_queue = queue.Queue()  # synchronous save: no spawn-method Manager
    req = dist_checkpointing.save(sharded_state_dict, path, sharded_strategy=_STRATEGY, async_sharded_save=True)
    if req.preload_fn is not None:
        # megatron stages device tensors with .to("cpu", non_blocking=True): pinned host memory from
        # torch's caching host allocator (every block rounded up to a power of two, kept cached after
        # the save). A blocking copy lands in ordinary, exact-size host memory, freed after the write.
        req = req._replace(preload_fn=functools.partial(filesystem_async.FileSystemWriterAsync.preload_tensors,
                                                        req.preload_fn.args[0], False))  # a NamedTuple
    req.execute_sync()
    del req, sharded_state_dict
    gc.collect()
    if dist.get_rank() == 0:
        if hf_config is not None:
            os.makedirs(os.path.join(path, HF_CONFIG_DIR), exist_ok=True)
            write_hf_metadata(os.path.join(path, HF_CONFIG_DIR), hf_config, None, tokenizer, model_path)
        with open(os.path.join(path, _META + ".tmp"), "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(os.path.join(path, _META + ".tmp"), os.path.join(path, _META))
    dist.barrier()


def save(tr, path: str) -> None:
    """Collective save into directory ``path`` (created; must be empty or absent)."""
    with_opt = bool(tr.cfg.checkpoint.save_optimizer)
    critic = tr.critic
    meta = {"version": tr.version, "sched": tr.sched, "optimizer": with_opt, "ref": tr.ref is not None,
            "critic": critic is not None, "critic_steps": critic.steps if critic is not None else 0,
            "layout": layout_of(), "family": tr.family.name, "layer_spec": tr.spec,
            "dtype": str(tr.dtype).removeprefix("torch.")}
    write_sharded(_sharded(tr, with_opt, tr.ref is not None, loading=False, with_critic=critic is not None), path, meta,
                  tr.hf_config, tr.tokenizer, tr.cfg.model.path)


@contextlib.contextmanager
def _step_tolerant_reshardable_load():
    """megatron-core 0.16.1 bug (torch AdamW, i.e. no TE / apex optimizer): loading the
    ``fully_reshardable`` distributed-optimizer format restores AdamW's per-parameter ``step``
    from the common state first, then copies *every* state key from the loaded shards, which
    deliberately omit ``step``: KeyError. While loading, keys absent from the shards are left as
    restored."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def wrap(orig):
        def patched(self, model_param, tensors):
            if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                group_index, group_order = self.model_param_group_index_map[model_param]
                main_param = self.optimizer.param_groups[group_index]["params"][group_order]
                st = self.optimizer.state[main_param]
                if "step" in st:
                    tensors = dict(tensors, step=st["step"])
            return orig(self, model_param, tensors)
        return patched

    with _patched_method(DistributedOptimizer, "_set_main_param_and_optimizer_states", wrap):
        yield


def _unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1 (torch AdamW path) restores one ``step`` tensor object into every
    parameter's state; AdamW increments each parameter's ``step`` in place, so a shared tensor
    advances once per parameter per optimizer step and corrupts the bias correction. Give every
    parameter its own copy."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        for st in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def read_meta(path: str) -> dict:
    meta_file = os.path.join(path, _META)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"{meta_file} is missing: not a complete megaforge megatron checkpoint")
    with open(meta_file) as f:
        return json.load(f)


#: Transformer Engine's switch for unpickling FP8 delayed-scaling ``_extra_state`` and the start of
#: the error it raises without it (transformer_engine/pytorch/_extra_state.py, TE 2.20)
TE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
TE_PICKLE_REFUSAL = "Refusing to load pickled Transformer Engine extra state"


class UntrustedCheckpointState(RuntimeError):
    """A checkpoint holds pickled state that is loaded only when the user says it is trusted."""


@contextlib.contextmanager
def te_extra_state_policy(path: str, trust: bool):
    """Around a ``load_state_dict`` of TE modules: with ``trust``, TE may unpickle FP8 delayed-scaling
    state (:data:`TE_PICKLE_ENV` = 1 inside, the previous value restored after); without it, TE's
    refusal becomes :class:`UntrustedCheckpointState` naming the checkpoint and the config key."""
    prev = os.environ.get(TE_PICKLE_ENV)
    if trust:
        os.environ[TE_PICKLE_ENV] = "1"
    try:
        yield
    except RuntimeError as e:
        if TE_PICKLE_REFUSAL not in str(e):
            raise
        raise UntrustedCheckpointState(
            f"{path}: holds Transformer Engine FP8 delayed-scaling state (scales, amax history) as a Python "
            f"pickle, which can run code when loaded; TE refused it ({str(e).split('.')[0]}). If you wrote or "
            f"trust this checkpoint, set checkpoint.trust_te_pickle: true (--checkpoint.trust_te_pickle true; "
            f"tools outside the trainer: {TE_PICKLE_ENV}=1)") from e
    finally:
        if trust:
            if prev is None:
                os.environ.pop(TE_PICKLE_ENV, None)
            else:
                os.environ[TE_PICKLE_ENV] = prev


def load(tr, path: str) -> None:
    """Collective load of what :func:`save` (or the HF -> Megatron converter) wrote, into the
    current layout (resharding as needed)."""
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    if meta.get("lora") is not None:
        raise RuntimeError(f"{path}: the checkpoint holds LoRA adapters but model.lora is null: resume with the "
                           "model.lora of the run that wrote it")
    if meta["family"] != tr.family.name:
        raise ValueError(f"{path}: checkpoint of family {meta['family']!r}, trainer is {tr.family.name!r}")
    saved_spec = meta.get("layer_spec", tr.spec)
    with_critic = bool(meta.get("critic", False))
    trust = bool(tr.cfg.checkpoint.trust_te_pickle)
    if not meta["optimizer"] and not meta["ref"] and not with_critic:  # weights only (e.g. the HF converter's)
        load_model(tr.bm, path, saved_spec, trust_te_pickle=trust)
        tr.optimizer.reload_model_params()  # fp32 main copies of bf16 / fp16 weights
        tr.version = int(meta["version"])
        if meta["sched"] is not None:
            tr.sched = dict(meta["sched"])
        return
    check_model_against(tr.bm, path, saved_spec, repad_vocab=False)
    if meta["ref"] and tr.ref is None:
        tr.snapshot_reference()  # allocate; overwritten below
    if with_critic and tr.critic is None:
        tr.init_critic()  # allocate; overwritten below
    sd = _sharded(tr, meta["optimizer"], meta["ref"], loading=True, saved_spec=saved_spec, with_critic=with_critic)
    state = dist_checkpointing.load(sd, path, sharded_strategy=_STRATEGY)
    with te_extra_state_policy(path, trust):  # the policy, reference and critic modules' TE state
        tr.bm.model.load_state_dict(state["model"], strict=True)
        if meta["ref"]:
            tr.ref.load_state_dict({k.removeprefix("ref."): v for k, v in state["ref"].items()}, strict=True)
        if with_critic:
            tr.critic.bm.model.load_state_dict({k.removeprefix("critic."): v for k, v in state["critic"].items()},
                                               strict=True)
    if meta["optimizer"]:
        with _step_tolerant_reshardable_load():
            tr.optimizer.load_state_dict(state["optimizer"])
        _unshare_adam_steps(tr.optimizer)
    if with_critic:
        if meta["optimizer"]:
            with _step_tolerant_reshardable_load():
                tr.critic.optimizer.load_state_dict(state["critic_optimizer"])
            _unshare_adam_steps(tr.critic.optimizer)
        else:
            tr.critic.optimizer.reload_model_params()
        tr.critic.steps = int(meta.get("critic_steps", 0))
    tr.version = int(meta["version"])
    if meta["sched"] is not None:  # weights-only checkpoints keep the trainer's fresh schedule
        tr.sched = dict(meta["sched"])


# ------------------------------------------------------------------ model-only access / checks
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def model_sharded_state_dict(bm, saved_spec: Optional[str] = None, metadata: Optional[dict] = None) -> dict:
    """The model's sharded state dict with keys as a checkpoint written under layer spec
    ``saved_spec`` (default: the model's own) names them. megatron's local spec already stores
    the norms under TE's names; only MoE layers' pre-MLP norm differs
    (:func:`megaforge.convert.families.checkpoint_key_to_spec`). TE's ``_extra_state`` objects are
    not requested from a ``torch`` checkpoint (which has none)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = bm.model.sharded_state_dict(metadata=metadata if metadata is not None else dict(_OPT_METADATA))
    saved_spec = saved_spec or bm.spec
    if saved_spec == bm.spec:
        return sd
    if saved_spec == "torch":
        sd = {k: v for k, v in sd.items() if not (isinstance(v, ShardedObject) and k.endswith("_extra_state"))}
    for v in nested_values(sd):
        if getattr(v, "key", None) is not None:
            v.key = checkpoint_key_to_spec(v.key, bm.spec, saved_spec, bm.desc.is_moe_layer)
    return sd


def check_model_against(bm, path: str, saved_spec: Optional[str] = None, repad_vocab: bool = True) -> None:
    """Raise ValueError unless every tensor this rank would load exists in checkpoint ``path`` with
    the same global shape and every data file holding checkpoint tensors is present. The padded
    vocabulary rows may differ (megatron pads to a multiple of 128 x TP, so checkpoints of
    different TP sizes differ) when ``repad_vocab`` (:func:`load_model` re-pads). Collective: all
    ranks fail together, with every rank's findings (tensor names and both shapes)."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    errors = []
    try:
        ckpt = load_tensors_metadata(path, sharded_strategy=None)
    except Exception as e:  # unreadable metadata
        ckpt = None
        errors.append(f"{path}: cannot read the checkpoint metadata ({type(e).__name__}: {e})")
    if ckpt is not None:
        sd, _, _ = load_preprocess(model_sharded_state_dict(bm, saved_spec))  # factories built
        seen = set()
        for v in nested_values(sd):
            if not isinstance(v, ShardedTensor) or v.key in seen:
                continue
            seen.add(v.key)
            want = tuple(v.global_shape)
            if v.key not in ckpt:
                errors.append(f"tensor {v.key}: missing from the checkpoint (the model expects shape {want}); "
                              "the checkpoint holds another family, layer spec or config")
                continue
            got = tuple(ckpt[v.key].global_shape)
            if got == want:
                continue
            if (repad_vocab and v.key in VOCAB_KEYS and got[1:] == want[1:] and got[0] >= bm.desc.vocab):
                continue  # same vocabulary, another TP's padding
            errors.append(f"tensor {v.key}: checkpoint shape {got}, model (from the config) shape {want}")
        if dist.get_rank() == 0:
            errors += missing_checkpoint_files(path)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)
    found = sorted({e for errs in everyone for e in errs})
    if found:
        raise ValueError(f"{path} does not match the model ({len(found)} problems):\n  " + "\n  ".join(found[:20]))


def _repad_vocab(sd: dict, path: str) -> dict:
    """Where the checkpoint's padded vocabulary Vc differs from the model's Vp, request the rows
    of this TP rank's shard [a, b) that exist in the checkpoint as fragments of g = gcd(Vc, Vp/tp)
    rows of the checkpoint's (Vc, H) tensor (a regular grid torch_dist can read), into a zeroed
    buffer; rows >= Vc stay zero (padding: every real row is < V <= Vc). Returns {state-dict key:
    (buffer, fragments)} for :func:`load_model` to put back."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ckpt = load_tensors_metadata(path)
    out = {}
    for k, v in list(sd.items()):
        if not isinstance(v, ShardedTensor) or v.key not in VOCAB_KEYS or v.key not in ckpt:
            continue
        vc = ckpt[v.key].global_shape[0]
        vp = v.global_shape[0]
        if vc == vp:
            continue
        rows = v.data.shape[0]
        a = v.global_offset[0]
        g = math.gcd(vc, rows)
        buf = torch.zeros_like(v.data)
        frags = {}
        for j in range(a // g, min(a + rows, vc) // g):
            frags[f"rows{j}"] = ShardedTensor.from_rank_offsets(
                v.key, buf[j * g - a:(j + 1) * g - a], (0, j, vc // g), replica_id=v.replica_id)
        sd[k] = frags
        out[k] = buf
    return out


def load_model(bm, path: str, saved_spec: Optional[str] = None, trust_te_pickle: bool = False) -> None:
    """Collective load of the model weights only (any checkpoint of :func:`save` / the converter,
    at any layout; optimizer and reference state ignored) into ``bm`` at the current layout, after
    :func:`check_model_against`; vocabulary padding of another TP size is re-padded. FP8
    delayed-scaling state of TE modules: :func:`te_extra_state_policy`."""
    from megatron.core import dist_checkpointing

    check_model_against(bm, path, saved_spec)
    sd = model_sharded_state_dict(bm, saved_spec)
    repadded = _repad_vocab(sd, path)
    state = dist_checkpointing.load({"model": sd}, path, sharded_strategy=_STRATEGY,
                                    validate_access_integrity=not repadded)["model"]
    for k, buf in repadded.items():
        state[k] = buf
    with te_extra_state_policy(path, trust_te_pickle):
        bm.model.load_state_dict(state, strict=True)
