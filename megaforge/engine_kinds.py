"""Rollout engine kinds (``rollout.engine``): one registry entry per kind, holding what the config
checks, the planner and the run's start-up need to know about it, and where its code is.

    ENGINE_KINDS.register("toy", EngineKind(build="my_pkg.toy:build", in_process=True))

A new kind is one module (its ``build`` and, if it has checks that need no engine yet, its
``preflight``) plus one registration: megaforge's own three are registered at the bottom of this file;
a plug-in registers its kind from its own module, imported before the config is read (``algo.plugins``).

This module sits low (megaforge.config and megaforge.planner read it; it imports neither torch nor
the engines): an entry names its code as ``package.module:callable``, imported when it is called
(:func:`call`). A callable is accepted too (tests, plug-ins).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

from megaforge.configtree import ConfigError, choice_error
from megaforge.registry import Registry, import_callable

Code = Union[str, Callable]


@dataclass(frozen=True)
class EngineKind:
    """What megaforge needs to know about one kind of rollout engine."""

    build: Code
    """``build(spec, tokenizer)``: start the engine(s) and return the :class:`megaforge.rollout.base.Engine`
    rank 0 drives; ``spec``: a :class:`megaforge.specs.EngineSpec` (the ``rollout`` and ``model``
    sections, the engines' dtype, seed, run directory, ``sync.transport``, ``sync.lora_adapters``). Multi-node jobs call a kind that is not ``in_process`` on every node leader with
    ``node=`` (a :class:`megaforge.placement.NodeEngines`: this node's engine ids and GPUs); it then
    returns None on node leaders other than rank 0."""
    in_process: bool = False
    """The engine lives in the trainer's rank-0 process (one engine, TP 1, colocated; the weights handed
    over in memory: sync.transport auto / inproc, sync.lora_adapters as tensors; no off-policy overlap). Else its
    engines are servers in their own processes, placed on GPUs by the planner's placement
    (:func:`megaforge.planner.layout.engine_gpus`), on several nodes too."""
    on_device: bool = True
    """Its engines run on ``rollout.device`` (the CPU included); False: always on CUDA GPUs."""
    max_tp: int = 0
    """The largest ``rollout.tensor_parallel`` it runs (0: any that divides the attention heads)."""
    preflight: Optional[Code] = None
    """``preflight(spec)`` (an EngineSpec): checks that need no engine yet (run at start-up, before any SFT or run
    directory), raising ConfigError; e.g. sglang installed in the engine interpreter."""
    lora_adapters: Literal["", "tensors", "folder"] = ""
    """How it takes LoRA adapters alone (``sync.lora_adapters``): ``tensors``, A and B handed over in
    memory and merged onto its kept base (``engine.update_adapters``); ``folder``, the trainer writes
    the PEFT adapter folder and the engine loads it by path (``engine.adapter_path`` /
    ``engine.load_adapter``, megaforge.rollout.http.lora); "": it gets the merged weights only."""
    memory: Literal["hf", "sglang"] = "hf"
    """The planner's memory model of an engine GPU (megaforge.planner.memory.engine_items): ``hf``, a
    Hugging Face model with a DynamicCache of ``rollout.engine_batch_size`` sequences; ``sglang``, a
    static pool of ``rollout.mem_fraction`` of the GPU with CUDA graphs."""


ENGINE_KINDS = Registry("rollout engine")


def engine_kind_names() -> list[str]:
    """The registered kinds, sorted (the valid values of ``rollout.engine``)."""
    return list(ENGINE_KINDS.names())


def engine_kind(name: str) -> EngineKind:
    """The entry of kind ``name``; an unknown one is a config error naming ``rollout.engine``, the
    registered kinds and the nearest one."""
    if name in ENGINE_KINDS:
        return ENGINE_KINDS.get(name)
    raise ConfigError(f"config key 'rollout.engine': {choice_error(name, engine_kind_names())}")


def call(code: Code, *args, **kwargs):
    """Run an entry's ``build`` / ``preflight`` (imported first when given as ``package.module:callable``)."""
    fn = import_callable(code, "rollout engine code") if isinstance(code, str) else code
    return fn(*args, **kwargs)


ENGINE_KINDS.register("embedded", EngineKind(build="megaforge.rollout.embedded.engine:EmbeddedEngine.from_spec",
                                             in_process=True, max_tp=1, lora_adapters="tensors"))
ENGINE_KINDS.register("embedded_server", EngineKind(build="megaforge.rollout.http.embedded_server:build", max_tp=1))
ENGINE_KINDS.register("sglang", EngineKind(build="megaforge.rollout.http.sglang:build", on_device=False,
                                           preflight="megaforge.rollout.http.sglang:preflight", memory="sglang",
                                           lora_adapters="folder"))
