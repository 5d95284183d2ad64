"""The frozen teacher of on-policy distillation (``algo.advantage: distill``, the ``teacher:`` section).

It lives on the trainer's device like the reference model and is read through
``Trainer.compute_logprobs(batch, "teacher")``: the per-token log-probs of the sampled tokens
(token-aligned [B, T], temperature applied, 0 at t = 0 / padding). The torch backend holds it as a
Hugging Face CausalLM (:func:`load_torch_teacher`); the megatron backend as a GPTModel at the
policy's TP / PP layout, built from the teacher's own HF config (it may be larger than the student)
and loaded through the same HF -> Megatron tables as the policy (:func:`build_megatron_teacher`).
Neither is trained, checkpointed (re-read from ``teacher.path`` on resume) or synced to engines;
colocated runs offload it with the trainer's other ``state``.

Where its weights come from (:func:`locate`): a Hugging Face folder, a megaforge run folder (its
newest complete checkpoint, else its newest ``hf/`` export) or one run checkpoint. Before anything
is loaded, :func:`check_vocabulary` refuses a teacher whose tokenizer (token -> id map) or
vocabulary size differs from the student's, naming both tokenizers.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from megaforge.configtree import ConfigError
from megaforge.hf import DTYPES, hf_config, load_hf_model, load_tokenizer


@dataclass
class TeacherSource:
    """Where the teacher comes from: ``model`` a ModelConfig-like section (path / config / tokenizer /
    dtype / attn_implementation) whose :func:`megaforge.hf.load_hf_model` gives the teacher's
    architecture (and weights, when ``state_dict`` is None); ``state_dict`` the HF weights of a
    torch-backend checkpoint; ``what`` names it in messages."""

    model: object
    state_dict: Optional[dict]
    what: str


def teacher_dtype(teacher, model) -> str:
    """``teacher.dtype``, the student's ``model.dtype`` when it is auto (``teacher``, ``model``: the sections)."""
    return model.dtype if teacher.dtype == "auto" else teacher.dtype


def _newest_export(run_dir: str) -> Optional[str]:
    hf = os.path.join(run_dir, "hf")
    if not os.path.isdir(hf):
        return None
    found = []
    for name in os.listdir(hf):
        m = re.fullmatch(r"(sft_)?step_(\d+)", name)
        if m and os.path.exists(os.path.join(hf, name, "config.json")):
            found.append(((0 if m.group(1) else 1, int(m.group(2))), os.path.join(hf, name)))
    return max(found)[1] if found else None


def locate(teacher, model) -> TeacherSource:
    """The teacher named by ``teacher.path`` (``teacher``: the :class:`~megaforge.config.teacher.TeacherConfig`
    section; ``model``: the student's ``model`` section, whose loading options an HF teacher folder takes);
    ConfigError naming ``teacher.path`` when it is none of the accepted forms."""
    from megaforge import checkpoint

    path, dtype = teacher.path, teacher_dtype(teacher, model)
    student = model

    def hf_dir(d: str, what: str) -> TeacherSource:
        model = dataclasses.replace(student, path=d, config="", tokenizer=d, dtype=dtype, trust_remote_code=False)
        return TeacherSource(model, None, what)

    if not os.path.isdir(path):
        raise ConfigError(f"config key 'teacher.path': {path!r} is not a folder here (an HF model folder, a run "
                          f"folder or a run checkpoint; relative paths are read from {os.getcwd()})")
    if os.path.exists(os.path.join(path, "config.json")):
        return hf_dir(path, f"HF folder {path}")
    ckpt = None
    if os.path.isdir(os.path.join(path, "checkpoints")):
        ckpt = checkpoint.latest_valid(os.path.join(path, "checkpoints"))
        if ckpt is None:
            export = _newest_export(path)
            if export is None:
                raise ConfigError(f"config key 'teacher.path': the run {path} has neither a complete checkpoint "
                                  "under checkpoints/ nor an hf/ export")
            return hf_dir(export, f"run {path}'s export {os.path.basename(export)}")
    elif os.path.isdir(os.path.join(path, "trainer")):
        why = checkpoint.verify(path)
        if why is not None:
            raise ConfigError(f"config key 'teacher.path': {path} is not a usable checkpoint: {why}")
        ckpt = path
    elif _newest_export(path) is not None:
        export = _newest_export(path)
        return hf_dir(export, f"run {path}'s export {os.path.basename(export)}")
    else:
        raise ConfigError(f"config key 'teacher.path': {path} is neither an HF model folder (config.json) nor a "
                          "megaforge run folder (checkpoints/, hf/) nor a run checkpoint (trainer/)")
    return _from_checkpoint(ckpt, dtype)


def _from_checkpoint(ckpt: str, dtype: str) -> TeacherSource:
    """A torch-backend run checkpoint: the run's ``model:`` section (architecture, tokenizer) from its
    config.yaml and the policy weights of ``trainer/trainer.pt``."""
    from megaforge import checkpoint
    from megaforge.config import load_config

    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    run_yaml = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(run_yaml):
        raise ConfigError(f"config key 'teacher.path': {ckpt} has no config.yaml in its run folder {run_dir}")
    run_cfg = load_config(["--config", run_yaml])
    if run_cfg.trainer.backend != "torch":
        raise ConfigError(f"config key 'teacher.path': {ckpt} is a {run_cfg.trainer.backend} checkpoint; export it "
                          f"first (python tools/convert_megatron_to_hf.py --ckpt {ckpt}/trainer --out DIR, or the "
                          "run's --export_hf_every) and give that HF folder")
    checkpoint.check_loadable(ckpt)
    f = os.path.join(ckpt, "trainer", "trainer.pt")
    state = torch.load(f, map_location="cpu", weights_only=True)["model"]
    model = dataclasses.replace(run_cfg.model, dtype=dtype, trust_remote_code=False)
    return TeacherSource(model, state, f"checkpoint {ckpt}")


def _tokenizer_name(tok, fallback: str) -> str:
    return getattr(tok, "name_or_path", "") or fallback


def check_vocabulary(model, source: TeacherSource, student_tokenizer=None):
    """ConfigError naming both tokenizers when the teacher's tokenizer maps tokens to ids otherwise
    than the student's (``model``: the student's ``model`` section), or when the two models' vocabulary
    sizes (embedding rows) differ: the teacher scores the student's token ids, which only mean the same
    tokens under one vocabulary. Returns the teacher's HF config."""
    student = student_tokenizer if student_tokenizer is not None else load_tokenizer(model)
    try:
        teacher = load_tokenizer(source.model)
    except OSError as e:
        raise ConfigError(f"config key 'teacher.path': the teacher ({source.what}) has no loadable tokenizer: {e}") from e
    s_name = _tokenizer_name(student, model.tokenizer or model.path)
    t_name = _tokenizer_name(teacher, source.model.tokenizer or source.model.path)
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        diff = sorted(set(sv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:3]
        example = ", ".join(f"{tok!r}: student id {sv.get(tok)}, teacher id {tv.get(tok)}" for tok, _ in diff)
        raise ConfigError(
            f"config key 'teacher.path': the teacher's tokenizer {t_name} ({len(tv)} tokens) differs from the "
            f"student's {s_name} ({len(sv)} tokens), e.g. {example}; on-policy distillation scores the student's "
            "token ids with the teacher, so both must use the same tokenizer")
    s_cfg, t_cfg = hf_config(model), hf_config(source.model)
    if s_cfg.vocab_size != t_cfg.vocab_size:
        raise ConfigError(
            f"config key 'teacher.path': the teacher's vocabulary has {t_cfg.vocab_size} rows, the student's "
            f"{s_cfg.vocab_size} (tokenizers {t_name} and {s_name}); both models must have the same vocab_size")
    return t_cfg


def _freeze(module: torch.nn.Module) -> torch.nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def load_torch_teacher(teacher, model, device: torch.device, student_tokenizer=None) -> torch.nn.Module:
    """The teacher as a frozen Hugging Face CausalLM on ``device`` (torch backend); ``teacher``, ``model``:
    the ``teacher`` and (the student's) ``model`` sections."""
    source = locate(teacher, model)
    check_vocabulary(model, source, student_tokenizer)
    dtype = DTYPES[teacher_dtype(teacher, model)]
    model = load_hf_model(source.model, torch.device("cpu") if source.state_dict is not None else device, dtype)
    if source.state_dict is not None:
        try:
            model.load_state_dict(source.state_dict)
        except RuntimeError as e:
            raise ConfigError(f"config key 'teacher.path': {source.what}: the saved weights do not fit its run's "
                              f"model.*: {str(e).splitlines()[0]}") from e
        model = model.to(device=device, dtype=dtype)
    return _freeze(model)


def build_megatron_teacher(trainer) -> torch.nn.Module:
    """The teacher as a frozen GPTModel (this rank's pipeline stage and TP shard) at ``trainer``'s
    parallel layout, its transformer config from the teacher's HF config (megatron backend)."""
    from megaforge.convert import families
    from megaforge.convert.mapping import HFSource
    from megaforge.trainer.megatron import model as mmodel

    cfg = trainer.cfg
    source = locate(cfg.teacher, cfg.model)
    t_hf = check_vocabulary(cfg.model, source, trainer.tokenizer)
    family = families.family_of(t_hf)
    desc = family.describe(t_hf)
    pp = cfg.trainer.pipeline_parallel
    if desc.num_layers % pp:
        raise ConfigError(f"config key 'teacher.path': the teacher has {desc.num_layers} layers, which "
                          f"trainer.pipeline_parallel {pp} does not divide (it is split like the student)")
    dtype = DTYPES[teacher_dtype(cfg.teacher, cfg.model)]
    tconfig = mmodel.config_without_hooks(
        mmodel.transformer_config(desc, cfg.trainer, dtype, trainer.device.type == "cpu", trainer.spec))
    bm = mmodel.build_model(desc, family, tconfig, trainer.spec, trainer.device)
    if source.state_dict is not None:
        hf_src = HFSource(state_dict=families.split_fused_experts(source.state_dict))
    else:
        hf_src = HFSource(path=source.model.path)
    mmodel.load_weights(bm, hf_src)
    return _freeze(bm.model)
