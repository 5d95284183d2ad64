"""megaforge: reinforcement-learning post-training of LLMs, from one CPU to many GPU nodes.

The Python API (:mod:`megaforge.api`) is exported here: ``megaforge.load_config``, ``megaforge.run_grpo``,
``megaforge.Session``, ``megaforge.build_trainer``, ``megaforge.build_engine``, ... Each is imported when
first used, so ``import megaforge`` (and every light module under it) does not import torch."""
__version__ = "0.1.0"

_API = ("Session", "build_engine", "build_rewards", "build_trainer", "generate", "load_config", "load_tokenizer",
        "prompt_rows", "push_weights", "run_grpo", "run_sft", "score", "train_step")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:  # by name: the package's own __init__ must not depend on a module under it
        import importlib

        return getattr(importlib.import_module("megaforge.api"), name)
    raise AttributeError(f"module 'megaforge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_API))
