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
* SGLang (``rollout.engine: sglang``): ``POST /get_weights_by_name`` ``{"name", "truncate_size"}``,
  which returns the first ``truncate_size`` rows (or values of a 1-D tensor) as float32 lists, for
  model families that implement it in SGLang (Llama-like; an engine answering null fails the check
  with that reason). Compared with a relative tolerance of one bfloat16 ulp (the engine's dtype is
  not reported), so it catches a wrong or missing tensor, not a last-bit rounding difference.

Digest (exact): ``sha256(dtype name | shape | raw bytes)`` of the tensor *in the engine's dtype*:
the trainer's tensor is cast with ``.to(engine_dtype)`` before hashing, which is what the engine's
load does (``param.copy_(t.to(param.dtype))``), so a correct load gives equal digests bit for bit.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch

PROBE_ROWS = 4
BF16_RTOL = 2.0 ** -7


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


class ProbeCheck:
    """SGLang servers: /get_weights_by_name on the first ``PROBE_ROWS`` rows of every tensor."""

    def __init__(self, engine, urls: list[str]):
        self.engine, self.urls = engine, urls
        self.expected: dict[str, torch.Tensor] = {}

    def record(self, name: str, t: torch.Tensor) -> None:
        head = t.detach()[:PROBE_ROWS] if t.dim() > 1 else t.detach().reshape(-1)[:PROBE_ROWS]
        self.expected[name] = head.float().cpu().clone()

    def verify(self) -> int:
        for name, want in self.expected.items():
            answers = self.engine.query("POST", "/get_weights_by_name", {"name": name, "truncate_size": PROBE_ROWS})
            for url, got in zip(self.urls, answers):
                if got is None:
                    raise WeightMismatchError(f"sync.check_equal: engine {url} cannot return {name!r} (SGLang's "
                                              f"/get_weights_by_name supports Llama-like families only)")
                g = torch.tensor(got, dtype=torch.float32)
                if g.shape != want.shape:
                    raise WeightMismatchError(f"sync.check_equal: {name!r} rows of shape {tuple(g.shape)} on engine {url}, "
                                              f"{tuple(want.shape)} on the trainer")
                if not torch.allclose(g, want, rtol=BF16_RTOL, atol=0.0):
                    d = (g - want).abs().max().item()
                    raise WeightMismatchError(f"sync.check_equal: {name!r} on engine {url} differs from the trainer's "
                                              f"after the update (max |diff| {d:.3g} in its first rows)")
        return len(self.expected)


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
    return ProbeCheck(engine, urls)


def check_engine_weights(trainer, engine, max_bytes: int = 512 << 20) -> int:
    """Compare ``engine``'s weights with ``trainer``'s now (outside an update): every trainer rank
    iterates its HF buckets (collective). Returns the number of tensors compared."""
    check = make_check(engine)
    for bucket in trainer.iter_hf_buckets(max_bytes):
        if check is not None:
            for n, t in bucket:
                check.record(n, t)
    return check.verify() if check is not None else 0
