"""Write a Hugging Face model directory the way transformers does, atomically.

Layout of a finished directory (what ``save_pretrained`` writes, transformers 5):

* one ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` ... plus
  ``model.safetensors.index.json`` = ``{"metadata": {"total_parameters": P, "total_size": B},
  "weight_map": {tensor name: file}}`` when the tensors exceed ``max_shard_bytes``. Sharding is
  greedy in arrival order, as transformers': a shard is closed when the next tensor would push it
  over the limit, so a single tensor larger than the limit gets a shard of its own;
* ``config.json`` (with ``dtype`` set to the weights' dtype), ``generation_config.json`` (copied from
  the source model, else derived from the config as transformers does) and the tokenizer files.

Atomicity: everything is written into a temporary folder next to ``out`` (same parent, so the final
``os.replace`` is a rename on one file system) and renamed when complete; on any error the
temporary folder is removed and ``out`` is left as it was. Used by the Megatron backend's export
(fed by its streaming bucket iterator), the offline converter and the torch backend.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from typing import Iterator, Optional

import torch

from megaforge.convert.ranks import leftovers  # noqa: F401  (re-exported)

#: transformers' v4 default shard size ("5GB"); the torch backend and the tools use it too
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


def parse_size(s) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"2GiB"`` / ``1000`` -> bytes (decimal units as transformers)."""
    if isinstance(s, int):
        return s
    t = str(s).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def make_tmp_dir(parent: str, prefix: str) -> str:
    """``tempfile.mkdtemp`` with the permissions of a plain ``mkdir`` (mkdtemp makes it 0700)."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


@contextlib.contextmanager
def atomic_output_dir(out: str, overwrite: bool = True) -> Iterator[str]:
    """Yield a fresh temporary folder in ``out``'s parent; on normal exit it replaces ``out``, on an
    exception it is removed (``out`` untouched). ``overwrite=False``: an existing non-empty ``out``
    is an error raised before anything is written."""
    out = os.path.abspath(out.rstrip("/"))
    parent, name = os.path.split(out)
    if not overwrite and os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    os.makedirs(parent, exist_ok=True)
    tmp = make_tmp_dir(parent, f".{name}.tmp-")
    try:
        yield tmp
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.replace(out, os.path.join(old, name))
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_hf_metadata(path: str, hf_config, dtype: Optional[torch.dtype] = None, tokenizer=None,
                      source_dir: str = "") -> None:
    """``config.json`` (``dtype`` set when given), ``generation_config.json`` and tokenizer files into
    ``path``. Tokenizer: ``tokenizer.save_pretrained`` when given, else the files present in
    ``source_dir``. Generation config: ``source_dir``'s, else derived from the config."""
    cfg = copy.deepcopy(hf_config)
    if dtype is not None:
        cfg.dtype = dtype
    cfg.save_pretrained(path)
    src_gen = os.path.join(source_dir, "generation_config.json") if source_dir else ""
    if src_gen and os.path.exists(src_gen):
        shutil.copy(src_gen, os.path.join(path, "generation_config.json"))
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(cfg).save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    elif source_dir and os.path.isdir(source_dir):
        for f in TOKENIZER_FILES:
            if os.path.exists(os.path.join(source_dir, f)):
                shutil.copy(os.path.join(source_dir, f), os.path.join(path, f))


class HFWriter:
    """Stream ``(name, tensor)`` pairs into an HF safetensors directory (see module doc).

    Holds at most one shard's tensors (on the host) at a time. ``dtype`` casts every tensor (None:
    kept). Use as a context manager, or call :meth:`finish` / :meth:`abort` yourself::

        with HFWriter(out, max_shard_bytes) as w:
            for name, t in pairs:
                w.add(name, t)
            w.finish(hf_config, source_dir=model_dir)
    """

    def __init__(self, out: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 dtype: Optional[torch.dtype] = None, overwrite: bool = True):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.out, self.max_shard_bytes, self.dtype = out, int(max_shard_bytes), dtype
        self._ctx = atomic_output_dir(out, overwrite)
        self.tmp = self._ctx.__enter__()
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self.total_parameters = 0
        self.dtypes: set = set()
        self._done = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self._pending:
            raise ValueError(f"HF tensor {name!r} written twice")
        t = tensor.detach()
        if self.dtype is not None:
            t = t.to(self.dtype)
        t = t.to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self.total_size += nbytes
        self.total_parameters += t.numel()
        self.dtypes.add(t.dtype)

    def add_bucket(self, bucket) -> None:
        for name, t in bucket:
            self.add(name, t)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        fname = f"part-{len(self._files):05d}.safetensors"
        save_file(self._pending, os.path.join(self.tmp, fname), metadata={"format": "pt"})
        self._files.append(fname)
        for n in self._pending:
            self.weight_map[n] = fname
        self._pending, self._pending_bytes = {}, 0

    def finish(self, hf_config, tokenizer=None, source_dir: str = "") -> str:
        """Write the last shard, the index, config, generation config and tokenizer; rename into
        place. Returns the final path."""
        self._flush()
        if not self._files:
            raise ValueError(f"{self.out}: no tensors were written")
        n = len(self._files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        rename = dict(zip(self._files, names))
        for old, new in rename.items():
            os.replace(os.path.join(self.tmp, old), os.path.join(self.tmp, new))
        self.weight_map = {k: rename[v] for k, v in self.weight_map.items()}
        if n > 1:
            index = {"metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
                     "weight_map": dict(sorted(self.weight_map.items()))}
            with open(os.path.join(self.tmp, "model.safetensors.index.json"), "w") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        dtype = next(iter(self.dtypes)) if len(self.dtypes) == 1 else None
        write_hf_metadata(self.tmp, hf_config, dtype, tokenizer, source_dir)
        self._done = True
        self._ctx.__exit__(None, None, None)
        return os.path.abspath(self.out.rstrip("/"))

    def abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._ctx.__exit__(RuntimeError, RuntimeError("aborted"), None)
            except RuntimeError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self._done:
            self.abort()
        return False
