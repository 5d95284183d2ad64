"""Model shapes from a Hugging Face ``config.json`` (no weights, no network) and parameter counts.

Notation: ``L`` layers, ``h`` hidden size, ``a`` / ``g`` query / key-value heads, ``d`` head dim,
``qd = a*d``, ``kvd = g*d``, ``F`` dense FFN size, ``V`` vocabulary; MoE: ``E`` experts, ``k`` experts
per token, ``Fe`` expert FFN size, ``Fs`` shared-expert FFN size.

Hugging Face parameter count (what ``sum(p.numel())`` of the transformers model gives, tied
embeddings counted once):

    attention  = h*qd + 2*h*kvd + qd*h  [+ qd + 2*kvd (qkv bias)] [+ h (o_proj bias)] [+ 2d (q/k norm)]
    norms      = 2h
    dense MLP  = 3*h*F
    MoE MLP    = E*h (router) + E*3*h*Fe [+ 3*h*Fs + h (shared expert and its gate)]
    total      = V*h (embedding) [+ V*h (untied lm_head)] + h (final norm) + sum over layers

Megatron holds a padded vocabulary ``Vp`` (multiple of 128 * TP, see
:func:`megaforge.convert.layouts.padded_vocab_size`) and splits every matrix over TP except the
norms and the router, which are replicated; experts are split over EP (whole experts) and expert-TP.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Optional

from megaforge.model_families import model_family, model_types

#: megatron's make_vocab_size_divisible_by in megaforge's backend (megaforge.trainer.megatron.model)
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule, as :func:`megaforge.convert.layouts.padded_vocab_size` (kept equal by the
    tests; not imported so that a dry run does not load torch): the smallest multiple of
    ``divisible_by * tp`` that is >= ``vocab``."""
    m = divisible_by * tp
    return ((vocab + m - 1) // m) * m

class _KnownTypes(Mapping):
    """{model type: whether the megatron backend has a family for it} of the model types the planner
    can describe: the registered model families (megaforge.model_families), read when asked."""

    def __getitem__(self, model_type: str) -> bool:
        fam = model_family(model_type)
        if fam is None:
            raise KeyError(model_type)
        return fam.megatron

    def __iter__(self) -> Iterator[str]:
        return iter(model_types())

    def __len__(self) -> int:
        return len(model_types())


#: model types the planner can describe, and whether the megatron backend has a family for them
KNOWN_TYPES: Mapping[str, bool] = _KnownTypes()


class ShapeError(ValueError):
    """The HF config cannot be read or described; the message names the file and field."""


@dataclass
class ModelShape:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    moe_layers: list = field(default_factory=list)  # indices of MoE layers
    max_position_embeddings: int = 0
    source: str = ""

    # -------------------------------------------------------------------------------- sizes
    @property
    def qd(self) -> int:
        return self.heads * self.head_dim

    @property
    def kvd(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and bool(self.moe_layers)

    @property
    def megatron_supported(self) -> bool:
        return KNOWN_TYPES.get(self.model_type, False)

    def attention_params(self, tp: int = 1) -> int:
        """One layer's attention weights on one TP rank (norm weights excluded)."""
        n = (self.qd + 2 * self.kvd) * self.hidden // tp + self.qd * self.hidden // tp
        if self.qkv_bias:
            n += (self.qd + 2 * self.kvd) // tp
        if self.o_bias:
            n += self.hidden  # row-parallel bias is replicated
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def dense_mlp_params(self, tp: int = 1) -> int:
        return 3 * self.hidden * self.ffn // tp

    def moe_params(self, ep: int = 1, etp: int = 1, tp: int = 1) -> tuple[int, int]:
        """(non-expert, expert) weights of one MoE layer on one rank: router (replicated) and shared
        expert (TP-split) / the E/ep local experts split over expert-TP."""
        dense = self.experts * self.hidden
        if self.shared_ffn:
            dense += 3 * self.hidden * self.shared_ffn // tp + self.hidden
        expert = (self.experts // ep) * 3 * self.hidden * self.expert_ffn // etp
        return dense, expert

    def padded_vocab(self, tp: int) -> int:
        return padded_vocab_size(self.vocab, VOCAB_DIVISIBLE_BY, tp)

    def hf_params(self) -> int:
        """Parameter count of the Hugging Face model (see module docstring)."""
        n = self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden
        for i in range(self.layers):
            n += self.attention_params() + 2 * self.hidden
            if i in self.moe_layers:
                d, e = self.moe_params()
                n += d + e
            else:
                n += self.dense_mlp_params()
        return n

    def lora_params(self, rank: int, targets: list) -> int:
        """Adapter parameters of ``model.lora`` (rank r, ``targets``: module names, matched by their last
        part): r * (in + out) per adapted linear layer, A [r, in] and B [out, r]. Per layer: q_proj (h, qd),
        k_proj / v_proj (h, kvd), o_proj (qd, h); in dense layers gate_proj / up_proj (h, F) and down_proj
        (F, h). MoE layers' experts are not counted (Hugging Face's MoE experts are fused tensors, not
        linear modules)."""
        h, f = self.hidden, self.ffn
        dims = {"q_proj": (h, self.qd), "k_proj": (h, self.kvd), "v_proj": (h, self.kvd), "o_proj": (self.qd, h)}
        mlp = {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
        names = {t.rsplit(".", 1)[-1] for t in targets}
        n = 0
        for i in range(self.layers):
            for name in names:
                io = dims.get(name) or (mlp.get(name) if i not in self.moe_layers else None)
                n += rank * sum(io) if io else 0
        return n

    def stage_params(self, tp: int, pp: int, stage: int, ep: int = 1, etp: Optional[int] = None) -> dict:
        """Megatron parameters on one rank of pipeline stage ``stage``: {dense, expert, embedding,
        output}. Layers are split evenly (L % pp == 0 is checked elsewhere); the first stage holds the
        embedding, the last the final norm and the output layer (with tied embeddings and pp > 1 the
        last stage keeps its own copy of the embedding matrix)."""
        etp = tp if etp is None else etp
        vp = self.padded_vocab(tp)
        per = self.layers // pp
        layers = range(stage * per, (stage + 1) * per)
        dense = expert = 0
        for i in layers:
            dense += self.attention_params(tp) + 2 * self.hidden
            if i in self.moe_layers:
                d, e = self.moe_params(ep, etp, tp)
                dense, expert = dense + d, expert + e
            else:
                dense += self.dense_mlp_params(tp)
        emb = vp * self.hidden // tp if stage == 0 else 0
        out = 0
        if stage == pp - 1:
            dense += self.hidden  # final norm
            if not self.tied or pp > 1:
                out = vp * self.hidden // tp
        return {"dense": dense, "expert": expert, "embedding": emb, "output": out}

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hf_params"] = self.hf_params()
        return d


# ------------------------------------------------------------------------------------- reading
def _first(d: dict, *names, default=None):
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def shape_from_dict(d: dict, source: str = "") -> ModelShape:
    """A :class:`ModelShape` from the fields of an HF config dict."""
    where = source or "HF config"

    def need(name, *alts):
        v = _first(d, name, *alts)
        if v is None:
            raise ShapeError(f"{where}: no '{name}' field")
        return v

    mt = need("model_type")
    if mt not in KNOWN_TYPES:
        raise ShapeError(f"{where}: model_type {mt!r} is not known to the planner; known: {', '.join(sorted(KNOWN_TYPES))}")
    if d.get("hidden_act", "silu") != "silu":
        raise ShapeError(f"{where}: hidden_act={d.get('hidden_act')!r}; the planner models SwiGLU (silu) MLPs only")
    if d.get("mlp_bias"):
        raise ShapeError(f"{where}: mlp_bias=true is not supported")
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    layers = int(need("num_hidden_layers"))
    fam = model_family(mt)
    experts = int(_first(d, "num_experts", default=0) or 0) if fam.moe else 0
    moe_layers: list[int] = []
    if experts:
        step = int(_first(d, "decoder_sparse_step", default=1))
        only_mlp = set(d.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(layers) if i not in only_mlp and step > 0 and (i + 1) % step == 0]
    return ModelShape(
        model_type=mt, layers=layers, hidden=hidden, heads=heads,
        kv_heads=int(_first(d, "num_key_value_heads", default=heads)),
        head_dim=int(_first(d, "head_dim", default=hidden // heads)),
        ffn=int(need("intermediate_size")), vocab=int(need("vocab_size")),
        tied=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=fam.qkv_bias or bool(d.get("attention_bias", False)),
        o_bias=fam.o_bias and bool(d.get("attention_bias", False)),
        qk_norm=fam.qk_norm,
        experts=experts, topk=int(_first(d, "num_experts_per_tok", default=0) or 0) if experts else 0,
        expert_ffn=int(_first(d, "moe_intermediate_size", default=0) or 0) if experts else 0,
        shared_ffn=int(_first(d, "shared_expert_intermediate_size", default=0) or 0) if experts else 0,
        moe_layers=moe_layers, max_position_embeddings=int(_first(d, "max_position_embeddings", default=0)),
        source=source,
    )


def _config_file(path: str) -> Optional[str]:
    f = os.path.join(path, "config.json") if os.path.isdir(path) else path
    return f if os.path.isfile(f) else None


def _hub_cached_config(repo: str) -> Optional[str]:
    """``config.json`` of a hub id from the local Hugging Face cache only (never the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        got = try_to_load_from_cache(repo, "config.json")
    except Exception:  # a malformed repo id
        return None
    return got if isinstance(got, str) and os.path.isfile(got) else None


def read_shape(model_cfg, override: str = "") -> ModelShape:
    """The policy's shape, offline. Looked up in order: ``override`` (``--model_config``: a
    config.json or a folder holding one), ``model.config``, ``model.path`` as a local folder,
    ``model.path`` as a hub id already in the local HF cache."""
    tried = []
    for key, path in (("--model_config", override), ("model.config", model_cfg.config), ("model.path", model_cfg.path)):
        if not path:
            continue
        f = _config_file(path) or (_hub_cached_config(path) if key == "model.path" else None)
        if f is None:
            tried.append(f"{key}={path!r}")
            if key != "model.path":
                raise ShapeError(f"{key} {path!r}: no config.json there")
            continue
        return _load_shape(f, key)
    raise ShapeError(
        "cannot read the model's HF config offline (tried " + (", ".join(tried) or "nothing: model.path is empty")
        + "): pass --model_config configs/models/<name> (a folder with config.json) or set model.config")


def read_teacher_shape(teacher_cfg, override: str = "") -> Optional[ModelShape]:
    """The distillation teacher's shape (``teacher:`` section), offline: ``override`` (``--teacher_config``:
    a config.json or a folder holding one), else ``teacher.path`` when it is an HF folder here. None when
    neither names one (teacher.path a run folder, or a folder of another machine): the caller says the
    teacher is not counted. ShapeError when ``override`` has no config.json or a file cannot be described."""
    for key, path in (("--teacher_config", override), ("teacher.path", teacher_cfg.path)):
        if not path:
            continue
        f = _config_file(path)
        if f is None:
            if key == "--teacher_config":
                raise ShapeError(f"--teacher_config {path!r}: no config.json there")
            return None
        return _load_shape(f, key)
    return None


def _load_shape(f: str, key: str) -> ModelShape:
    try:
        with open(f) as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ShapeError(f"{key} {f}: cannot read the HF config: {e}") from None
    return shape_from_dict(data, f)
