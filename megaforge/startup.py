"""Start-up resolution: every component the config names is resolved before any work (run directory,
tokenizer, SFT warm start) and by ``--dry_run``, so a bad name fails in seconds, as one
``megaforge: config error:`` line naming the config key and the nearest registered name.

Resolved: ``algo.plugins`` (imported; any exception at import names the module), ``algo.advantage``,
``algo.loss``, ``algo.loss_agg``, ``algo.kl_estimator`` (registered names or
``package.module:callable``), ``rewards.functions[i].name`` (and its ``kwargs`` against the reward's
constructor or function), ``rollout.generate_fn``, and a synthetic ``data.path`` / ``sft.data.path``.

Shapes are checked where megaforge calls a function: a class given where a function is expected
(torchforge's ``nn.Module`` loss) is refused, not adapted (torchforge's loss takes the reference
log-probs as its ratio's denominator and returns the aggregated scalar; megaforge's returns the
per-token term and adds KL and aggregation itself: examples/custom_loss/seed_loss.py ports one), and
a function whose signature cannot take megaforge's arguments is refused with the expected signature.
"""
from __future__ import annotations

import inspect
import os

from megaforge import model_source
from megaforge.configtree import ConfigError

#: config key -> (registry attribute in megaforge.algorithms.core, expected signature, positional args)
ALGO_COMPONENTS = {
    "algo.advantage": ("ADVANTAGES", "fn(inputs: AdvantageInputs, p: ObjectiveParams) -> advantages [B, T]", 2),
    "algo.loss": ("POLICY_LOSSES", "fn(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams) -> "
                  "(per-token loss [B, T], {metric: [B, T]}), every tensor [B, T]", 5),
    "algo.loss_agg": ("LOSS_AGGS", "fn(x [B, T], mask [B, T], num_tokens, num_seqs, norm) -> scalar", 5),
    "algo.kl_estimator": ("KL_ESTIMATORS", "fn(logprobs [B, T], ref_logprobs [B, T]) -> KL [B, T]", 2),
}
GENERATE_FN = "fn(engine, requests, rows, tokenizer, ctx: GenerateContext, **rollout.generate_kwargs) -> list[Sample]"
REWARD_FN = "fn(prompt, response, target, **kwargs) -> float (a class: cls(**kwargs), then called so)"
#: a synthetic data.path that names a file: these endings, or a path separator
FILE_ENDINGS = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")


def _refuse_shape(key: str, name: str, obj, expected: str, nargs: int, kwargs: dict | None = None) -> None:
    """ConfigError when ``obj`` (resolved from ``name`` at ``key``) is a class or cannot take ``nargs``
    positional arguments (plus ``kwargs``)."""
    if inspect.isclass(obj):
        torch_module = any(c.__module__.startswith("torch.nn") for c in inspect.getmro(obj)[1:])
        what = "a torch.nn.Module class (torchforge's form of a loss)" if torch_module else "a class"
        raise ConfigError(f"config key '{key}': {name!r} is {what}, megaforge calls a function: {expected}; "
                          f"write it as a function (examples/custom_loss/seed_loss.py ports torchforge's "
                          f"CustomLoss)")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # a builtin or C callable: no signature to check
    try:
        sig.bind(*range(nargs), **(kwargs or {}))
    except TypeError as e:
        raise ConfigError(f"config key '{key}': {name!r}{sig} cannot be called as {expected} ({e})") from None


def resolve_algo(algo) -> None:
    """``algo.plugins`` imported, then each algorithm component of the ``algo`` section looked up and its
    shape checked."""
    from megaforge.algorithms import core  # lazy: torch (config building imports it too)
    from megaforge.algorithms.params import load_plugins, resolve_loss_agg

    load_plugins(algo.plugins)
    for key, (reg_name, expected, nargs) in ALGO_COMPONENTS.items():
        name = getattr(algo, key.split(".")[1])
        if name is None:  # algo.loss_agg null: the loss's own
            continue
        try:
            obj = getattr(core, reg_name).get(name)
        except ValueError as e:
            raise ConfigError(f"config key '{key}': {e}") from None
        _refuse_shape(key, name, obj, expected, nargs)
    resolve_loss_agg(algo)


def resolve_rewards(rewards) -> None:
    """Each ``rewards.functions`` entry's reward found (registered by megaforge or an ``algo.plugins``
    module, or ``package.module:callable`` imported) and its ``kwargs`` taken by it."""
    from megaforge.rewards import REWARDS  # lazy: light, but only runs that reward need it

    for i, spec in enumerate(rewards.functions):
        key = f"rewards.functions[{i}]"
        try:
            obj = REWARDS.get(spec.name)
        except ValueError as e:
            raise ConfigError(f"config key '{key}.name': {e}") from None
        if REWARDS.declared(spec.name).get("from_spec"):
            continue  # configured by its own typed keys (checked by Config.validate)
        target = obj.__init__ if inspect.isclass(obj) else obj
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        args = (None,) if inspect.isclass(obj) else (None, None, None)  # (self,) or (prompt, response, target)
        try:
            sig.bind(*args, **spec.kwargs)
        except TypeError as e:
            raise ConfigError(f"config key '{key}.kwargs': reward {spec.name!r} does not take {spec.kwargs} ({e}); "
                              f"a reward is {REWARD_FN}") from None


def resolve_generate_fn(rollout) -> None:
    """``rollout.generate_fn`` imported and its shape checked against ``rollout.generate_kwargs``."""
    path = rollout.generate_fn
    if not path:
        return
    from megaforge.registry import import_callable

    try:
        obj = import_callable(path, "rollout.generate_fn")
    except ValueError as e:
        raise ConfigError(f"config key 'rollout.generate_fn': {e}") from None
    _refuse_shape("rollout.generate_fn", path, obj, GENERATE_FN, 5, dict(rollout.generate_kwargs))


def check_synthetic(data_cfg, key: str) -> None:
    """A synthetic ``data.path`` names a registered task; a file name there (the demo config pins
    ``format: synthetic``, then ``--data.path my.jsonl``) says to set the format."""
    if data_cfg is None or data_cfg.format != "synthetic" or ":" in data_cfg.path:
        return
    from megaforge.data.synthetic import SYNTHETIC_TASKS  # lazy: only synthetic data needs it

    path = data_cfg.path
    if path in SYNTHETIC_TASKS:
        return
    if os.path.exists(path) or path.endswith(FILE_ENDINGS) or os.sep in path:
        fmt = "parquet" if path.endswith(".parquet") else "hf" if os.path.isdir(path) and not any(
            f.endswith(".jsonl") for f in os.listdir(path)) else "jsonl"
        there = "" if os.path.exists(path) else f" (no such file under {os.getcwd()} yet)"
        raise ConfigError(f"config key '{key}.path': {path!r} is a file path{there} but {key}.format is 'synthetic' "
                          f"(a generated task's name): set --{key}.format {fmt} (or auto) to read prompts from it")
    try:
        SYNTHETIC_TASKS.get(path)
    except ValueError as e:
        raise ConfigError(f"config key '{key}.path': {e} ({key}.format is 'synthetic'; for a file of prompts set "
                          f"--{key}.format jsonl / parquet / hf)") from None


def resolve(cfg, mode: str = "grpo", dry_run: bool = False) -> None:
    """Everything above for a run of ``mode`` (grpo: all of it; sft: the data and the plug-ins), and the
    model sources (megaforge.model_source). A dry run leaves those to the planner: it plans for another
    machine (where /data/model exists, or with --model_config) and reads no weights."""
    why = None if dry_run else model_source.check_config(cfg.model, cfg.critic, cfg.rewards)
    if why:
        raise ConfigError(why)
    check_synthetic(cfg.sft.data if cfg.sft.data is not None else cfg.data, "sft.data" if cfg.sft.data else "data")
    if cfg.sft.data is not None and mode == "grpo":
        check_synthetic(cfg.data, "data")
    if mode == "sft":
        from megaforge.algorithms.params import load_plugins  # lazy: as above

        load_plugins(cfg.algo.plugins)
        return
    resolve_algo(cfg.algo)
    resolve_rewards(cfg.rewards)
    resolve_generate_fn(cfg.rollout)
