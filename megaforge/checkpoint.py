"""Run checkpoints: atomic, checksummed, resumable.

Layout: ``<run dir>/checkpoints/step_000012/`` (RL step 12; ``sft_step_000050/`` during the SFT warm
start, ordered before every RL checkpoint) holding ``trainer/`` (the backend's own files),
``state.json`` (loop state: phase, steps, data position, weight version), ``rng_rank{R}.pt`` and,
written last, ``manifest.json`` (size and sha256 of every file: files over :data:`PIECE_BYTES` as the
sha256 of each piece, so that the pieces of all files are hashed in parallel; manifests written before
that, whole-file sha256 only, still verify). A checkpoint is written under
``.tmp-step_000012`` and renamed when complete, so a crash never leaves a half checkpoint under a
real name. :func:`latest_valid` skips (and names) any checkpoint whose manifest is missing, not of
the form written (:func:`manifest_problem`: e.g. ``{}`` or ``[]``) or whose files do not match it,
falling back to the previous one.

Loading is safe against a crafted checkpoint (a matching manifest proves integrity, not origin):
before the trainer reads anything, :func:`check_loadable` opens every ``*.pt`` file with
``torch.load(weights_only=True)`` (memory-mapped: the tensors are not read), so it holds tensors and
plain containers only, whichever backend reads it later (megatron-core's own ``torch.load`` calls
pass no ``weights_only``); unpickles every ``*.metadata`` file (torch.distributed.checkpoint's, which
torch reads with plain ``pickle.load``) with an allowlist of torch's checkpoint metadata classes;
and refuses to run when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` would turn those defaults off. A refused
file raises :class:`CheckpointRefused` naming it and the refused global; nothing in it is run.
"""
from __future__ import annotations

import dataclasses
import enum
import errno
import hashlib
import importlib
import json
import os
import pickle
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megaforge import collective

_NAME = re.compile(r"^(sft_)?step_(\d+)$")


#: files are checksummed in pieces of this many bytes, the pieces of every file on one thread pool
#: (file reads and hashlib's update release the GIL): one core hashes ~1.2 GB/s, so a 1.7B model's 24 GB
#: checkpoint (weights, fp32 master copy, Adam moments) cost ~20 s at the save and again at a resume
PIECE_BYTES = 256 << 20


def hash_threads() -> int:
    """Threads hashing a checkpoint's pieces: one a core, at most 16 (beyond, the disk or memory is the limit)."""
    return max(1, min(16, os.cpu_count() or 1))


def _sha256_range(path: str, offset: int, length: int) -> str:
    """sha256 of ``length`` bytes of ``path`` from ``offset`` (fewer where the file is shorter)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while length > 0:
            b = f.read(min(4 << 20, length))
            if not b:
                break
            h.update(b)
            length -= len(b)
    return h.hexdigest()


def _hash_all(tasks: list[tuple[str, int, int]]) -> list[str]:
    """``[(path, offset, length)]`` -> their sha256 hex digests, in order, on :func:`hash_threads` threads."""
    if len(tasks) <= 1:
        return [_sha256_range(*t) for t in tasks]
    with ThreadPoolExecutor(max_workers=hash_threads()) as ex:
        return list(ex.map(lambda t: _sha256_range(*t), tasks))


def _pieces(path: str, size: int, piece: int) -> list[tuple[str, int, int]]:
    return [(path, off, piece) for off in range(0, max(size, 1), piece)]


def _files(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if rel != "manifest.json":
                out.append(rel)
    return sorted(out)


def write_manifest(root: str) -> None:
    """``manifest.json``: ``{rel: {"bytes": n, "sha256": hex}}`` for a file of at most
    :data:`PIECE_BYTES` (its whole-file sha256), ``{rel: {"bytes": n, "piece_bytes": P,
    "sha256_pieces": [hex of bytes [0, P), [P, 2P), ...]}}`` for a larger one."""
    piece = PIECE_BYTES
    rels = _files(root)
    sizes = {rel: os.path.getsize(os.path.join(root, rel)) for rel in rels}
    tasks = {rel: _pieces(os.path.join(root, rel), sizes[rel], piece) for rel in rels}
    digests = iter(_hash_all([t for rel in rels for t in tasks[rel]]))
    manifest = {}
    for rel in rels:
        d = [next(digests) for _ in tasks[rel]]
        manifest[rel] = ({"sha256": d[0], "bytes": sizes[rel]} if len(d) == 1
                         else {"bytes": sizes[rel], "piece_bytes": piece, "sha256_pieces": d})
    tmp = os.path.join(root, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "manifest.json"))


#: files every checkpoint holds (written before its manifest): a manifest that leaves one out is not a checkpoint's
REQUIRED_FILES = ("state.json",)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _digest(v) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None


def manifest_problem(manifest) -> Optional[str]:
    """None when ``manifest`` (parsed JSON) has the form :func:`write_manifest` writes, else what is wrong:
    a mapping of relative paths inside the checkpoint (no ``..``, not absolute) to ``{"bytes": n >= 0,
    "sha256": hex}`` or ``{"bytes": n, "piece_bytes": P > 0, "sha256_pieces": [ceil(n / P) (at least
    1) hex digests]}``, listing every file of :data:`REQUIRED_FILES`."""
    if not isinstance(manifest, dict):
        return f"expected a mapping of file -> size and sha256, got {type(manifest).__name__}"
    for rel, info in manifest.items():
        parts = rel.replace("\\", "/").split("/")
        if not rel or rel.startswith("/") or ".." in parts or "" in parts:
            return f"entry {rel!r} is not a relative path inside the checkpoint"
        if not isinstance(info, dict) or not _count(info.get("bytes")):
            return f"entry {rel!r}: expected {{'bytes': n >= 0, ...}}, got {info!r:.200}"
        if "sha256_pieces" in info:
            piece, digests = info.get("piece_bytes"), info["sha256_pieces"]
            if not (_count(piece) and piece > 0 and isinstance(digests, list) and all(map(_digest, digests))
                    and len(digests) == max(1, -(-info["bytes"] // piece))):
                return (f"entry {rel!r}: expected piece_bytes > 0 and one sha256 per piece of its "
                        f"{info['bytes']} bytes")
        elif not _digest(info.get("sha256")):
            return f"entry {rel!r}: no sha256 (64 hex digits)"
    missing = [r for r in REQUIRED_FILES if r not in manifest]
    if missing:
        return f"{missing[0]} is not listed ({len(manifest)} files are): not a complete checkpoint's manifest"
    return None


def verify(root: str) -> Optional[str]:
    """None when ``root`` is a complete checkpoint, else the reason it is not (the first file in the
    manifest's order that is missing, of another size or of other content)."""
    mf = os.path.join(root, "manifest.json")
    if not os.path.exists(mf):
        return "no manifest.json (incomplete write)"
    try:
        with open(mf, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        return f"unreadable manifest.json: {e}"
    why = manifest_problem(manifest)
    if why is not None:
        return f"invalid manifest.json: {why}"
    want, tasks = {}, {}
    for rel, info in manifest.items():
        p = os.path.join(root, rel)
        if not os.path.exists(p):
            return f"missing file {rel}"
        if os.path.getsize(p) != info["bytes"]:
            return f"{rel}: {os.path.getsize(p)} bytes, manifest says {info['bytes']}"
        if "sha256_pieces" in info:
            want[rel], tasks[rel] = info["sha256_pieces"], _pieces(p, info["bytes"], info["piece_bytes"])
        else:  # one whole-file digest (a small file, or a manifest from before the pieces)
            want[rel], tasks[rel] = [info["sha256"]], [(p, 0, max(info["bytes"], 1))]
    got = iter(_hash_all([t for rel in manifest for t in tasks[rel]]))
    bad = [rel for rel in manifest if [next(got) for _ in tasks[rel]] != want[rel]]
    return f"{bad[0]}: checksum mismatch" if bad else None


def checkpoint_name(step: int, phase: str = "rl") -> str:
    return f"{'sft_' if phase == 'sft' else ''}step_{step:06d}"


def list_checkpoints(ckpt_dir: str) -> list[tuple[tuple[int, int], str]]:
    """Complete-or-not checkpoints, oldest first: SFT ones, then RL ones, by step."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        m = _NAME.match(name)
        if m:
            out.append(((0 if m.group(1) else 1, int(m.group(2))), os.path.join(ckpt_dir, name)))
    return sorted(out)


# verify() results, keyed by the real path and the (name, size, mtime) of every file: a checkpoint
# is hashed once per process while its files do not change (those this process wrote are valid by
# construction), so pruning after every save does not read every kept checkpoint again
_VERDICTS: dict[tuple, Optional[str]] = {}


def _verdict_key(path: str) -> Optional[tuple]:
    try:
        stats = []
        for d, _, files in os.walk(path):
            for f in files:
                st = os.stat(os.path.join(d, f))
                stats.append((os.path.relpath(os.path.join(d, f), path), st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    return (os.path.realpath(path), tuple(sorted(stats))) if stats else None


def verdict(path: str) -> Optional[str]:
    """:func:`verify`, remembered while the checkpoint's files are unchanged."""
    key = _verdict_key(path)
    if key is None:
        return verify(path)
    if key not in _VERDICTS:
        _VERDICTS[key] = verify(path)
    return _VERDICTS[key]


def latest_valid(ckpt_dir: str, log: Callable[[str], None] = print) -> Optional[str]:
    """Newest complete checkpoint; corrupt or partial ones are reported and skipped."""
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        why = verdict(path)
        if why is None:
            return path
        log(f"[megaforge] checkpoint {path} is not usable ({why}); falling back to an earlier one")
    return None


def prune(ckpt_dir: str, keep_last_n: int, protect=(), log: Callable[[str], None] = print) -> list[str]:
    """Delete what is not kept; returns the deleted paths. Kept: the ``keep_last_n`` newest *valid*
    checkpoints (a corrupt one does not count), always the newest valid one, and every path in
    ``protect`` (the checkpoint the run resumed from). Corrupt or partial checkpoints are deleted."""
    entries = [path for _, path in list_checkpoints(ckpt_dir)]
    valid = [p for p in entries if verdict(p) is None]
    keep = set(valid[-max(keep_last_n, 1):]) | {os.path.realpath(p) for p in protect if p}
    keep = {os.path.realpath(p) for p in keep}
    deleted = []
    for p in entries:
        if os.path.realpath(p) not in keep:
            why = verdict(p)
            if why is not None:
                log(f"[megaforge] deleting checkpoint {p}: not usable ({why})")
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (full disk, I/O error): the message names the path and cause."""


def _write_failure(e: BaseException, final: str, ckpt_dir: str) -> Optional[str]:
    """A message for an I/O failure while writing ``final`` (None: not an I/O failure)."""
    cause, err = e, None
    while cause is not None and err is None:
        err = cause if isinstance(cause, OSError) and cause.errno else None
        cause = cause.__cause__ or cause.__context__
    if err is not None:
        what = f"{os.strerror(err.errno)} ({errno.errorcode.get(err.errno, err.errno)})"
        where = f" at {err.filename}" if err.filename else ""
    elif any(k in str(e) for k in ("PytorchStreamWriter", "inline_container", "iostream error", "file write failed")):
        what, where = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}", ""
    else:
        return None
    try:
        free = f"; {shutil.disk_usage(ckpt_dir).free / 2**20:.1f} MiB free on its filesystem"
    except OSError:
        free = ""
    return (f"writing checkpoint {final} failed: {what}{where}{free}. The partial write was removed; the "
            f"earlier checkpoints are intact (free space, then continue with --resume)")


def save(ckpt_dir: str, step: int, trainer, loop_state: dict, keep_last_n: int, phase: str = "rl",
         protect=(), tensor_files: Optional[dict] = None) -> str:
    """Collective: every rank calls it. Returns the final checkpoint path. Written under
    ``.tmp-NAME`` (removed again when writing fails: :class:`CheckpointWriteError` naming the path
    and the cause, e.g. ENOSPC), then renamed; then :func:`prune` keeps ``keep_last_n`` valid ones
    and every path in ``protect``. ``tensor_files`` (main rank): ``{file name: {name: tensor}}``
    written as safetensors next to ``state.json`` (read back with :func:`read_tensors`)."""
    name = checkpoint_name(step, phase)
    final = os.path.join(ckpt_dir, name)
    tmp = os.path.join(ckpt_dir, ".tmp-" + name)
    try:
        if collective.is_main():
            os.makedirs(ckpt_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        collective.barrier()
        trainer.save(os.path.join(tmp, "trainer"))
        write_torch(_rng_tensors(), os.path.join(tmp, f"rng_rank{collective.rank()}.pt"))
        collective.barrier()
        if collective.is_main():
            with open(os.path.join(tmp, "state.json"), "w") as f:
                json.dump(loop_state, f, indent=1)
            for name, tensors in (tensor_files or {}).items():
                write_tensors(tensors, os.path.join(tmp, name))
            write_manifest(tmp)
            _rename_into_place(tmp, final)
    except BaseException as e:
        if collective.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        msg = _write_failure(e, final, ckpt_dir)
        if msg:
            raise CheckpointWriteError(msg) from e
        raise
    if collective.is_main():
        key = _verdict_key(final)
        if key is not None:
            _VERDICTS[key] = None  # its manifest was just computed from the files written
        prune(ckpt_dir, keep_last_n, protect)
    collective.barrier()
    return final


def _rename_into_place(tmp: str, final: str) -> None:
    old = None
    if os.path.exists(final):  # keep the old one until the new one has its name
        old = os.path.join(os.path.dirname(final), ".old-" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def write_torch(obj, path: str) -> None:
    """``torch.save`` through a Python file, so that a failed write raises OSError with its errno
    (given a path, torch's C++ writer reports a full disk as ``basic_ios::clear``)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or not what it should be (the message names it)."""


def write_tensors(tensors: dict, path: str) -> None:
    """``{name: tensor}`` (host copies) as a safetensors file at ``path``."""
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, path)


def read_tensors(path: str) -> dict:
    """The ``{name: tensor}`` of safetensors file ``path`` (:func:`write_tensors`); CheckpointError
    naming the file when it is missing, truncated or not a safetensors file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or damaged?): {e}") from None


def _rng_tensors() -> dict:
    """RNG states as tensors / plain lists so they load with ``weights_only=True``."""
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _restore_rng(state: dict) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointRefused(RuntimeError):
    """A checkpoint file holds pickled objects outside the allowlist (code, arbitrary classes)."""


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str",
                                           "bytes", "bytearray", "complex", "slice", "object")} | {
    ("collections", "OrderedDict"), ("copyreg", "_reconstructor"), ("copyreg", "__newobj__"),
    ("copyreg", "__newobj_ex__"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint metadata only: its dataclasses and enums, torch dtypes/layouts/sizes."""

    def find_class(self, module, name):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def check_loadable(path: str) -> None:
    """Refuse (:class:`CheckpointRefused`) a checkpoint whose pickles name anything but tensors, plain
    containers and checkpoint metadata; see the module docstring."""
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        raise CheckpointRefused("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch.load calls without weights_only "
                                f"(megatron-core's) would unpickle arbitrary objects from {path}; unset it to resume")
    for rel in _files(path):
        f = os.path.join(path, rel)
        try:
            if rel.endswith(".pt"):
                try:
                    torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:  # a file torch cannot memory-map (old format): read it whole
                    if "mmap" not in str(e):
                        raise
                    torch.load(f, map_location="cpu", weights_only=True)
            elif rel.endswith(".metadata"):
                with open(f, "rb") as fh:
                    _MetadataUnpickler(fh).load()
        except pickle.UnpicklingError as e:
            m = re.search(r"(?:Unsupported global: GLOBAL |global )(\S+)", str(e))
            what = f"global {m.group(1)}" if m else str(e).strip().splitlines()[0]
            raise CheckpointRefused(f"checkpoint file {f} was refused: its pickle names {what}, which is not a "
                                    f"tensor, a plain container or checkpoint metadata (weights_only=True); it was "
                                    f"not loaded and nothing in it ran") from None


def load(path: str, trainer) -> dict:
    """Collective: restore the trainer and this rank's RNG; returns the loop state."""
    check_loadable(path)
    trainer.load(os.path.join(path, "trainer"))
    rng_file = os.path.join(path, f"rng_rank{collective.rank()}.pt")
    if os.path.exists(rng_file):
        _restore_rng(torch.load(rng_file, weights_only=True))
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)
