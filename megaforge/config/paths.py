"""Relative paths in a config file: read from the current directory when they exist there (what
megaforge always did), else from the config file's folder (``configs/my.yaml`` naming
``models/tiny`` finds ``configs/models/tiny`` from any directory). Values given on the command line are
the user's, relative to the current directory, and are not touched."""
from __future__ import annotations

import os

#: dotted keys of the tree holding paths ("[]": every element of a list)
PATH_KEYS = ("model.path", "model.config", "model.tokenizer", "data.path", "sft.data.path", "critic.path",
             "eval.sets[].path")


def _resolve(value, folder: str):
    if not isinstance(value, str) or not value or os.path.isabs(value) or value.startswith("~"):
        return value
    if os.path.exists(value):
        return value  # the current directory first: configs written for it keep working
    there = os.path.join(folder, value)
    return there if os.path.exists(there) else value


def _walk(node, parts: list[str], folder: str) -> None:
    head, rest = parts[0], parts[1:]
    many = head.endswith("[]")
    name = head[:-2] if many else head
    if not isinstance(node, dict) or name not in node:
        return
    if many:
        items = node[name] if isinstance(node[name], list) else []
        for item in items:
            _walk(item, rest, folder)
    elif rest:
        _walk(node[name], rest, folder)
    else:
        node[name] = _resolve(node[name], folder)


def config_relative(tree: dict, config_path: str) -> None:
    """Rewrite in place the relative paths of :data:`PATH_KEYS` in the YAML ``tree`` read from ``config_path``."""
    folder = os.path.dirname(config_path)
    for key in PATH_KEYS:
        _walk(tree, key.split("."), folder)
