"""Where a model named by the config comes from, checked before anything loads it: a path that looks
local and does not exist is refused at once (transformers would take it for a hub id and spend a minute
on retries, or say "Repo id must be in the form"); with ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``)
set, a hub id not in the local cache is refused without a network call. Light: no torch, no hub client.

Looks local: starts with ``/``, ``./``, ``../`` or ``~``, is ``.`` / ``..``, or holds more than one
``/`` (a hub id is ``name`` or ``org/name``). Relative paths are read from the current directory (a
config file's relative paths also from its folder: megaforge.config.paths).
"""
from __future__ import annotations

import os
import re
from typing import Optional

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
TRUE = ("1", "on", "yes", "true")


def looks_local(source: str) -> bool:
    if source.startswith(("/", "./", "../", "~")) or source in (".", ".."):
        return True
    return source.count("/") > 1 or (os.sep != "/" and os.sep in source) or not HUB_ID.fullmatch(source)


def offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache() -> str:
    """The hub cache folder, by huggingface_hub's rule (HF_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME, ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def in_cache(repo_id: str) -> bool:
    snaps = os.path.join(hub_cache(), "models--" + repo_id.replace("/", "--"), "snapshots")
    return os.path.isdir(snaps) and any(os.scandir(snaps))


def problem(key: str, source: str, cache: bool = True) -> Optional[str]:
    """Why ``source`` (config key ``key``: a model folder or hub id) cannot be loaded, or None; ``cache``
    False: a hub id is not checked against the cache (a dry run reads no weights)."""
    if not source or os.path.exists(os.path.expanduser(source)):
        return None
    if looks_local(source):
        return (f"config key '{key}': {source!r} looks like a local path and does not exist (relative paths are "
                f"read from the current directory {os.getcwd()}); give an existing folder or a hub id 'org/name'")
    if cache and offline() and not in_cache(source):
        return (f"config key '{key}': {source!r} is no folder under the current directory {os.getcwd()}, and as a hub "
                f"id it is not in the local hub cache {hub_cache()} while HF_HUB_OFFLINE is set: give an existing "
                f"folder, download it first (huggingface-cli download {source}) or unset HF_HUB_OFFLINE")
    return None


def model_keys(model, critic, rewards) -> list[tuple[str, str, bool]]:
    """(config key, value, hub id allowed) of every model source of the ``model``, ``critic`` and
    ``rewards`` sections (reward models, judges)."""
    out = [("model.path", model.path, True), ("model.tokenizer", model.tokenizer, True),
           ("model.config", model.config, False), ("critic.path", critic.path, True)]
    for i, f in enumerate(rewards.functions):
        k = f"rewards.functions[{i}]"
        if f.name == "reward_model":
            out += [(f"{k}.reward_model.path", f.reward_model.path, True),
                    (f"{k}.reward_model.tokenizer", f.reward_model.tokenizer, True)]
        if f.name == "llm_judge":
            out += [(f"{k}.judge.model.{n}", getattr(f.judge.model, n), n != "config") for n in ("path", "tokenizer", "config")]
    return out


def check_config(model, critic, rewards, cache: bool = True) -> Optional[str]:
    """The first model source of the ``model``, ``critic`` and ``rewards`` sections (:func:`model_keys`)
    that cannot be loaded (a one-line message), or None (``cache``: as in :func:`problem`)."""
    for key, value, hub in model_keys(model, critic, rewards):
        if value and not hub and not os.path.exists(os.path.expanduser(value)):
            return f"config key '{key}': {value!r}: no such file or folder (relative paths are read from {os.getcwd()})"
        why = problem(key, value, cache) if hub else None
        if why:
            return why
    return None
