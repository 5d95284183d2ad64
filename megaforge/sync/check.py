"""``sync.check_equal``: after an update, the engine's weights are compared with what was sent.

Every tensor the trainer sends is recorded as it streams by (no second copy of the model is kept)
and compared, after the update, with the engine's tensor of the same HF name. The first mismatch
raises :class:`WeightMismatchError` naming the tensor (and the engine); a tensor the engine lacks,
or of another shape, too.

How the engine's side is read, by engine:

* in-process (``rollout.engine: embedded``): ``engine.named_weights()``; digests compared.
* megaforge's embedded server: ``POST /get_weights_checksum`` ``{"names": [..] | null, "hash": bool}``
  -> ``{"success": true, "algorithm": "sha256", "tensors": {name: {"dtype", "shape", "sha256"}}}``;
  asked once without hashes before the update (the engine's dtypes) and once with after it.
* SGLang (``rollout.engine: sglang``): ``POST /weights_checker`` ``{"action": "checksum"}``, which
  returns every served tensor's 64-bit content hash per TP rank, in SGLang's own layout (fused
  qkv / gate-up, padded vocabulary, TP shards); :mod:`megaforge.sync.sglang_checksum` builds the same
  tensors from the trainer's and hashes them the same way: exact, for every model family SGLang
  serves (``/get_weights_by_name`` answers only for Llama-like ones). A tensor the engine holds and
  the trainer did not send fails the check too.

Digest (exact): ``sha256(dtype name | shape | raw bytes)`` of the tensor *in the engine's dtype*:
the trainer's tensor is cast with ``.to(engine_dtype)`` before hashing, which is what the engine's
load does (``param.copy_(t.to(param.dtype))``), so a correct load gives equal digests bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch

from megaforge.sync import sglang_checksum as sc


class WeightMismatchError(RuntimeError):
    pass


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of ``t``'s dtype, shape and bytes (hex)."""
    t = t.detach()
    h = hashlib.sha256()
    h.update(f"{dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _parse_dtype(name: str) -> torch.dtype:
    d = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise WeightMismatchError(f"sync.check_equal: the engine reports an unknown dtype {name!r}")
    return d


class _DigestCheck:
    """Digests in the engine's dtype; ``actual()`` returns {name: (dtype, shape, digest)}."""

    def __init__(self, dtypes: dict[str, torch.dtype], where: str):
        self.dtypes, self.where = dtypes, where
        self.expected: dict[str, tuple] = {}

    def record(self, name: str, t: torch.Tensor) -> None:
        dt = self.dtypes.get(name, t.dtype)
        self.expected[name] = (tuple(t.shape), tensor_digest(t.detach().to(dt)))

    def compare(self, actual: dict) -> int:
        bad = []
        for name, (shape, digest) in self.expected.items():
            if name not in actual:
                raise WeightMismatchError(f"sync.check_equal: {self.where} has no tensor {name!r}")
            a_shape, a_digest = actual[name]
            if tuple(a_shape) != shape:
                raise WeightMismatchError(f"sync.check_equal: {name!r} has shape {tuple(a_shape)} on {self.where}, "
                                          f"{shape} on the trainer")
            if a_digest != digest:
                bad.append(name)
        if bad:
            raise WeightMismatchError(f"sync.check_equal: {bad[0]!r} on {self.where} differs from the trainer's after "
                                      f"the update (sha256 {actual[bad[0]][1][:12]} vs {self.expected[bad[0]][1][:12]}"
                                      f"; {len(bad)} of {len(self.expected)} tensors differ: {bad[:5]})")
        return len(self.expected)


class InProcessCheck(_DigestCheck):
    def __init__(self, engine):
        self.engine = engine
        super().__init__({n: t.dtype for n, t in engine.named_weights().items()}, "the engine")

    def verify(self) -> int:
        w = self.engine.named_weights()
        return self.compare({n: (tuple(w[n].shape), tensor_digest(w[n])) for n in self.expected if n in w})


class ChecksumCheck(_DigestCheck):
    """megaforge's embedded server(s): /get_weights_checksum."""

    def __init__(self, engine, urls: list[str]):
        self.engine, self.urls = engine, urls
        metas = engine.query("POST", "/get_weights_checksum", {"names": None, "hash": False})
        dtypes = {}
        for m in metas:
            dtypes.update({n: _parse_dtype(v["dtype"]) for n, v in m["tensors"].items()})
        super().__init__(dtypes, "the engine")

    def verify(self) -> int:
        answers = self.engine.query("POST", "/get_weights_checksum", {"names": sorted(self.expected), "hash": True})
        n = 0
        for url, ans in zip(self.urls, answers):
            self.where = f"engine {url}"
            n = self.compare({k: (v["shape"], v["sha256"]) for k, v in ans["tensors"].items()})
        return n


class SGLangChecksumCheck:
    """Real SGLang servers: /weights_checker hashes against the trainer's tensors in SGLang's layout."""

    def __init__(self, engine, urls: list[str], infos: list[dict]):
        self.sc, self.engine, self.urls = sc, engine, urls
        self.tp = list(getattr(engine, "tp_sizes", None) or [1] * len(urls))
        hf = _model_config(infos[0], getattr(engine, "model_dir", ""))
        self.num_kv = int(hf.get("num_key_value_heads") or hf.get("num_attention_heads") or 1)
        self.tied = bool(hf.get("tie_word_embeddings", False))
        self.dtypes = [_engine_dtype(i, hf, u) for i, u in zip(infos, urls)]
        self.layouts = sorted({(tp, dt) for tp, dt in zip(self.tp, self.dtypes)}, key=str)
        self.pending: dict[str, dict] = {}
        self.expected: dict[tuple, dict[int, dict[str, str]]] = {lay: {} for lay in self.layouts}

    def record(self, name: str, t: torch.Tensor) -> None:
        target, part = self.sc.engine_target(name)
        parts = self.pending.setdefault(target, {})
        parts[part] = t.detach()
        kind = target.rsplit(".", 2)[-2] if target.count(".") >= 2 else ""
        need = self.sc.PARTS[kind] if part is not None else (None,)
        if not all(p in parts for p in need):
            return  # the other projections of this fused tensor come next
        del self.pending[target]
        for dt in {dt for _, dt in self.layouts}:
            cast = {k: v.to(dt) for k, v in parts.items()}
            for tp in [tp for tp, d in self.layouts if d == dt]:
                for r in range(tp):
                    h = self.sc.hash_hex(self.sc.engine_tensors(target, cast, r, tp, self.num_kv))
                    self.expected[(tp, dt)].setdefault(r, {})[target] = h

    def verify(self) -> int:
        if self.pending:
            name, parts = next(iter(self.pending.items()))
            raise WeightMismatchError(f"sync.check_equal: the trainer sent only {sorted(map(str, parts))} of SGLang's "
                                      f"fused tensor {name!r}")
        answers = self.engine.query("POST", "/weights_checker", {"action": "checksum"})
        n = 0
        for url, ans, tp, dt in zip(self.urls, answers, self.tp, self.dtypes):
            ranks = ans.get("ranks") if isinstance(ans, dict) else None
            if not ranks:
                raise WeightMismatchError(f"sync.check_equal: engine {url}/weights_checker gave no per-rank checksums: "
                                          f"{str(ans)[:300]}")
            for info in ranks:
                r = int(info["parallelism_info"]["tp_rank"])
                got, want = info["checksums"], self.expected[(tp, dt)].get(r, {})
                where = f"engine {url} (TP rank {r} of {tp})"
                missing = [k for k in want if k not in got and not (k == "lm_head.weight" and self.tied)]
                if missing:
                    raise WeightMismatchError(f"sync.check_equal: {where} has no tensor {missing[0]!r} "
                                              f"({len(missing)} missing)")
                unsent = sorted(k for k in got if k not in want)
                if unsent:
                    raise WeightMismatchError(f"sync.check_equal: {where} serves {unsent[0]!r}, which the trainer did "
                                              f"not send ({len(unsent)} such: {unsent[:5]})")
                bad = [k for k in want if k in got and got[k] != want[k]]
                if bad:
                    raise WeightMismatchError(
                        f"sync.check_equal: {bad[0]!r} on {where} differs from the trainer's after the update "
                        f"(hash {got[bad[0]]} vs {want[bad[0]]}; {len(bad)} of {len(want)} tensors differ: {bad[:5]})")
                n = max(n, len([k for k in want if k in got]))
        return n


def _model_config(info: dict, model_dir: str) -> dict:
    """The served model's config.json (from /server_info's model_path where it is a local folder)."""
    for d in (info.get("model_path") or "", model_dir or ""):
        p = os.path.join(d, "config.json")
        if d and os.path.exists(p):
            with open(p) as f:
                return json.load(f)
    return {}


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "float": torch.float32, "fp32": torch.float32}


def _engine_dtype(info: dict, hf: dict, url: str) -> torch.dtype:
    name = str(info.get("dtype", "auto"))
    if name == "auto":  # SGLang serves the checkpoint's dtype (float32 checkpoints in bfloat16)
        name = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
        name = "bfloat16" if name == "float32" else name
    if name not in _DTYPES:
        raise WeightMismatchError(f"sync.check_equal: engine {url} serves dtype {name!r}, which megaforge cannot hash")
    return _DTYPES[name]


def make_check(engine):
    """The check for ``engine`` (None when there is no engine on this rank)."""
    if engine is None:
        return None
    query = getattr(engine, "query", None)
    if query is None:
        return InProcessCheck(engine)
    urls = [c.url for c in engine.clients]
    infos = query("GET", "/server_info")
    if all(isinstance(i, dict) and i.get("frontend") == "megaforge-embedded" for i in infos):
        return ChecksumCheck(engine, urls)
    if any(isinstance(i, dict) and i.get("frontend") == "megaforge-embedded" for i in infos):
        raise WeightMismatchError("sync.check_equal: the engines mix megaforge's embedded server and SGLang")
    return SGLangChecksumCheck(engine, urls, infos)


def check_engine_weights(trainer, engine, max_bytes: int = 512 << 20) -> int:
    """Compare ``engine``'s weights with ``trainer``'s now (outside an update): every trainer rank
    iterates its HF buckets (collective). Returns the number of tensors compared."""
    check = make_check(engine)
    for bucket in trainer.iter_hf_buckets(max_bytes):
        if check is not None:
            for n, t in bucket:
                check.record(n, t)
    return check.verify() if check is not None else 0
