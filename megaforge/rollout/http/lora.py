"""LoRA adapters alone to SGLang servers (``sync.lora_adapters`` with ``rollout.engine: sglang``).

The servers start with LoRA on (:func:`lora_flags`: ``--enable-lora --max-lora-rank r
--lora-target-modules ...``) and serve the frozen base. Each sync
(:func:`megaforge.sync.adapters.push_adapters`):

1. the trainer writes the PEFT adapter folder of the new version (``Trainer.export_adapter``: the
   same writer as ``<run>/adapter/``; ``adapter_config.json`` + ``adapter_model.safetensors``) to
   :meth:`AdapterServing.adapter_path`, a per-version folder under one temporary folder of this
   engine (the servers read it: same machine);
2. :meth:`AdapterServing.load_adapter` loads it on every server under a new name
   (``POST /load_lora_adapter {"lora_name": "policy-v<version>", "lora_path": <folder>}``, sglang
   0.5.16 ``LoadLoRAAdapterReqInput``), then sets the servers' weight version
   (``/update_weight_version`` with ``abort_all_requests: false``: 0.5.16's default aborts);
3. from then on every ``/generate`` sends ``lora_path: [name, ...]`` (``GenerateReqInput.lora_path``:
   an adapter *name*), so the servers compute y = x W0^T + (lora_alpha / r) x A^T B^T per request;
4. the previous adapter is retired: once no ``generate`` of this engine still uses it, it is unloaded
   (``POST /unload_lora_adapter {"lora_name"}``; SGLang itself also waits for its requests in flight)
   and its folder deleted.

Before the first sync no adapter is loaded and requests name none: the base, which equals the fresh
adapted policy (B = 0). A restarted server gets the current adapter again (:meth:`_reload_adapter`).
SGLang's errors raise :class:`AdapterError`, naming the server, the endpoint, the adapter's name and
folder and the HTTP status.
"""
from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
from typing import Optional

from megaforge.rollout.http.client import EngineHTTPError


class AdapterError(RuntimeError):
    """A server refused an adapter load / unload (``.status``: its HTTP status)."""

    def __init__(self, err: EngineHTTPError, name: str, path: str):
        super().__init__(f"{err.url}{err.endpoint}: LoRA adapter {name!r} (folder {path}): HTTP {err.status}: "
                         f"{err.body[:2000].strip()}")
        self.status, self.name, self.path = err.status, name, path


#: ``--lora-target-modules`` choices of sglang 0.5.16 (``srt/utils/common.py`` SUPPORTED_LORA_TARGET_MODULES)
SGLANG_TARGETS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b", "wk",
    "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head",
    "qkvr", "wo_ud"})


def check_targets(spec) -> None:
    """ConfigError naming ``model.lora.target_modules`` when sync.lora_adapters would start SGLang with a
    target it does not know (its argument parser would refuse the server's command line)."""
    from megaforge.configtree import ConfigError

    if not spec.lora_adapters or spec.model.lora is None:
        return
    bad = sorted({t.split(".")[-1] for t in spec.model.lora.target_modules} - SGLANG_TARGETS)
    if bad:
        raise ConfigError(f"config key 'model.lora.target_modules': SGLang serves adapters on {sorted(SGLANG_TARGETS)} "
                          f"only, not {bad}: drop them or set sync.lora_adapters false (merged weights)")


def lora_flags(lora, colocated: bool, max_loras_per_batch: int = 3) -> list[str]:
    """SGLang server flags (sglang 0.5.16 ``server_args``) for adapters of ``model.lora`` loaded at run
    time: ``--enable-lora``, ``--max-lora-rank`` (the adapters' r), ``--lora-target-modules`` (the PEFT
    names q_proj / k_proj / v_proj / o_proj / gate_proj / up_proj / down_proj are SGLang's choices too;
    it stacks q/k/v into qkv_proj and gate/up into gate_up_proj itself) and ``--max-loras-per-batch``
    (3, SGLang counting the base as one: base-only requests of before the first sync, the retiring
    adapter's and the new one's may share a batch with off-policy overlap; a fourth would wait). Full dotted target names
    are passed by their last part (SGLang matches on it). ``colocated`` (the server runs with
    ``--enable-memory-saver`` and releases its weights while the trainer trains): also
    ``--enable-weights-cpu-backup``, since the base is never sent again and must come back from the
    server's own host copy on resume (0.5.16 discards released weights otherwise)."""
    targets = sorted({t.split(".")[-1] for t in lora.target_modules})
    return (["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *targets,
             "--max-loras-per-batch", str(max_loras_per_batch)] + (["--enable-weights-cpu-backup"] if colocated else []))


class AdapterServing:
    """Mixin of HTTPEngine (which provides ``clients``, ``_call``, ``cleanup_dirs``)."""

    def _init_adapters(self) -> None:
        self._adapter_root: Optional[str] = None
        self._adapter: Optional[tuple[str, str, int]] = None  # (name, folder, version) served now
        self._retired: list[tuple[str, str, set]] = []  # (name, folder, servers holding it) to unload once unused
        self._inflight: collections.Counter = collections.Counter()  # adapter name -> generate calls using it
        self._names: set[str] = set()
        self._adapter_lock = threading.Lock()

    @property
    def adapter_name(self) -> Optional[str]:
        """The adapter every new request names (None: the base, before the first adapter sync)."""
        return self._adapter[0] if self._adapter else None

    def adapter_path(self, version: int) -> str:
        """The folder the trainer writes version ``version``'s PEFT adapter to."""
        if self._adapter_root is None:
            self._adapter_root = tempfile.mkdtemp(prefix="megaforge-lora-")
            self.cleanup_dirs.append(self._adapter_root)
        return os.path.join(self._adapter_root, f"v{version}")

    def load_adapter(self, path: str, version: int) -> None:
        """Load the PEFT folder ``path`` on every server as the adapter of ``version``; new requests use
        it from then on; the previous one is unloaded when no request of this engine uses it any more."""
        name = f"policy-v{version}"
        while name in self._names:  # a version pushed twice (a resumed run): SGLang names must be new
            name += "+"
        for client in self.clients:
            self._load_on(client, name, path, version)
        self._names.add(name)
        with self._adapter_lock:
            if self._adapter is not None:
                self._retired.append((*self._adapter[:2], set(range(len(self.clients)))))
            self._adapter = (name, path, version)
        self._unload_unused()

    def _load_on(self, client, name: str, path: str, version: int) -> None:
        try:
            self._call(client.load_lora_adapter(name, path))
        except EngineHTTPError as e:
            raise AdapterError(e, name, path) from None
        self._call(client.request("POST", "/update_weight_version",
                                  {"new_version": str(version), "abort_all_requests": False}))

    def _acquire_adapter(self) -> Optional[str]:
        """The adapter a ``generate`` call sends (counted in flight until :meth:`_release_adapter`)."""
        with self._adapter_lock:
            name = self.adapter_name
            if name is not None:
                self._inflight[name] += 1
            return name

    def _release_adapter(self, name: Optional[str]) -> None:
        if name is None:
            return
        with self._adapter_lock:
            self._inflight[name] -= 1
            if self._inflight[name] <= 0:
                del self._inflight[name]
        self._unload_unused()

    def _unload_unused(self) -> None:
        """Unload (and delete the folder of) every retired adapter no ``generate`` call uses now."""
        with self._adapter_lock:
            done = [r for r in self._retired if self._inflight[r[0]] <= 0]
            self._retired = [r for r in self._retired if r not in done]
        for name, path, servers in done:
            for k in sorted(servers):
                try:
                    self._call(self.clients[k].unload_lora_adapter(name))
                except EngineHTTPError as e:
                    raise AdapterError(e, name, path) from None
            shutil.rmtree(path, ignore_errors=True)

    def _reload_adapter(self, k: int) -> bool:
        """A restarted server ``k`` (it came back with the base alone) loads the current adapter (the retired
        ones are gone from it: not unloaded there later); False when none is loaded yet."""
        with self._adapter_lock:
            for _, _, servers in self._retired:
                servers.discard(k)
        if self._adapter is None:
            return False
        name, path, version = self._adapter
        self._load_on(self.clients[k], name, path, version)
        return True
