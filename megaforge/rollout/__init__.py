"""Rollout engines behind :class:`megaforge.rollout.base.Engine`.

This ``__init__`` runs before every rollout module, light ones included (http.processes, which
megaforge.slurm imports on a login node; agent.tools): the engines and megaforge.hf (torch) are imported
where they are used."""
from __future__ import annotations

import os

from megaforge.configtree import ConfigError
from megaforge.engine_kinds import call, engine_kind
from megaforge.registry import import_callable


def preflight(spec, data, eval_cfg) -> None:
    """Checks that need no engine yet (run at start-up, before any SFT or run directory): sglang
    installed, rollout.generate_fn importable, prompt + response within the model's context, the
    engines' GPUs present. ``spec``: the :class:`~megaforge.specs.EngineSpec`
    (:meth:`megaforge.build.RunBuilder.engine_spec`, which the engine kind's own preflight receives);
    ``data`` and ``eval_cfg``: the ``data`` and ``eval`` sections (their prompt lengths)."""
    from megaforge.specs import EngineSpec, expect  # light

    expect(spec, EngineSpec, "preflight")
    rollout, model = spec.rollout, spec.model
    if rollout.generate_fn:
        try:
            import_callable(rollout.generate_fn, "rollout.generate_fn")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    kind = engine_kind(rollout.engine)
    if kind.preflight is not None:  # e.g. sglang installed in the engine interpreter
        call(kind.preflight, spec)
    check_context(model, data, rollout, eval_cfg)
    check_engine_gpus(rollout)
    if rollout.return_routed_experts:
        from megaforge.rollout.routing import run_routing_shape  # lazy: torch, see above

        run_routing_shape(True, model)  # a dense model: ConfigError


def context_limit(hf_cfg) -> int:
    """Positions the model serves: ``max_position_embeddings``, or the RoPE-scaled length (YaRN etc.)."""
    limit = int(getattr(hf_cfg, "max_position_embeddings", 0) or 0)
    rs = getattr(hf_cfg, "rope_scaling", None) or {}
    if isinstance(rs, dict) and rs.get("factor") and rs.get("original_max_position_embeddings"):
        limit = max(limit, int(rs["original_max_position_embeddings"] * rs["factor"]))
    return limit


def check_context(model, data, rollout, eval_cfg) -> None:
    """``data.max_prompt_len`` + ``rollout.max_new_tokens`` (and ``eval.max_new_tokens`` with eval sets)
    must fit the model's context (longer prompts are already refused row by row against
    data.max_prompt_len). ``model``, ``data``, ``rollout``, ``eval_cfg``: those sections."""
    from megaforge.hf import hf_config  # lazy: torch, see above

    try:
        hf = hf_config(model)
    except (OSError, ValueError):
        return  # an unreadable model is reported where it is loaded, with its own message
    limit = context_limit(hf)
    if eval_cfg.sets and eval_cfg.max_new_tokens > rollout.max_new_tokens:
        need = data.max_prompt_len + eval_cfg.max_new_tokens
        if limit and need > limit:
            raise ConfigError(f"config keys 'data.max_prompt_len' ({data.max_prompt_len}) + 'eval.max_new_tokens' "
                              f"({eval_cfg.max_new_tokens}) = {need} tokens exceed the model's context of {limit}; "
                              f"lower one of them")
    need = data.max_prompt_len + rollout.max_new_tokens
    if limit and need > limit:
        src = model.path or model.config
        raise ConfigError(f"config keys 'data.max_prompt_len' ({data.max_prompt_len}) + 'rollout.max_new_tokens' "
                          f"({rollout.max_new_tokens}) = {need} tokens exceed the model's context of {limit} "
                          f"(max_position_embeddings of {src}): a prompt of the allowed length would not get a full "
                          f"response; lower one of them")


def check_engine_gpus(r) -> None:
    """The GPUs the engines are configured to use exist on this node (``r``: the ``rollout`` section;
    rollout.device, rollout.num_gpus, rollout.num_engines x rollout.tensor_parallel); multi-node
    placement is checked by the planner."""
    from megaforge.hf import DeviceError, resolve_device  # lazy: torch, see above

    kind = engine_kind(r.engine)
    if kind.on_device:
        try:
            dev = resolve_device(r.device)
        except DeviceError as e:
            raise ConfigError(f"config key 'rollout.device': {e}") from None
        if kind.in_process or dev.type != "cuda":
            return
    if int(os.environ.get("WORLD_SIZE", "1")) != int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        return
    from megaforge.rollout.http.start import gpu_assignment, visible_gpus  # lazy: torch, see above

    visible = visible_gpus()
    if not visible:
        raise ConfigError(f"config key 'rollout.engine': {r.engine!r} runs its engines on CUDA GPUs and none is "
                          f"visible here (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    try:
        gpu_assignment(r.num_engines, r.tensor_parallel, r.num_gpus, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                       visible)
    except ValueError as e:
        raise ConfigError(f"config keys 'rollout.num_engines' / 'rollout.tensor_parallel' / 'rollout.num_gpus': "
                          f"{e}") from None


def build_engine(spec, tokenizer):
    """The engine of ``spec`` (a :class:`megaforge.specs.EngineSpec`, from
    :meth:`megaforge.build.RunBuilder.engine_spec`: ``rollout.engine``, its kind's ``build``), built on the
    rank that feeds engines; every engine of a kind not in-process on this node (multi-node jobs:
    :func:`megaforge.placement.build_engines`)."""
    from megaforge.specs import EngineSpec, expect

    spec = expect(spec, EngineSpec, "build_engine")
    return call(engine_kind(spec.rollout.engine).build, spec, tokenizer)
