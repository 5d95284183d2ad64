"""Evaluate a model on held-out prompts: greedy pass@1, sampled pass@k, rewards, response length.

    python tools/evaluate.py --model HF_DIR --data test.jsonl [--k 8] [--out samples.jsonl] [--key value ...]
    python tools/evaluate.py --model RUN_DIR                  # the run's latest checkpoint, its eval.sets
    python tools/evaluate.py --model RUN_DIR/checkpoints/step_000040 --data gsm8k_test.jsonl --k 8
    python tools/evaluate.py --model base/ --model step10/ --model step20/ --data test.jsonl --out 'e_{model}.jsonl'

``--model`` is a Hugging Face folder (also a run's ``hf/step_N`` export) or a run checkpoint (a run
folder: its newest complete checkpoint), whose weights are written to a temporary HF folder first
(torch backend: the saved state dict into the run's model; megatron: tools/convert_megatron_to_hf.py).
The prompts, chat template, rewards and engine are those of a run's ``config.yaml`` (or ``--config
FILE``), with megaforge's defaults otherwise; any config key can be overridden (``--rollout.engine
embedded_server``, ``--data.system_prompt "..."``, ``--eval.max_new_tokens 512``). ``--data`` evaluates
one set (a .jsonl / .parquet file or folder, or a `datasets` dataset with ``--split``); without it the
run's ``eval.sets``. For a run, the set is checked disjoint from the run's training prompts
(``--eval.check_disjoint false`` to score training prompts on purpose).

Remote code is never trusted unless ``--trust_remote_code`` is given here: a run folder's (or
``--config``'s) ``trust_remote_code: true`` anywhere (model, reward model, judge) would make
transformers import Python files from a model folder (``auto_map``), so without the flag evaluate
refuses, naming the model and the key, before anything is loaded. With the flag, the config's values
hold and ``model.trust_remote_code`` is set true.

Several ``--model`` are evaluated in turn through one engine start (a checkpoint series, several systems'
exports): the engine starts on the first; each next one's weights (its ``*.safetensors``, cast to the
engine's dtype) reach the same engine through its weight update, as a run's sync sends them (weight version
1, 2, ...). The prompts, chat template, rewards and engine are the first model's; each next model must
have the same architecture (``config.json``: the keys of ``SAME_ARCH``), else evaluate stops naming the key
and both folders. One JSON line is printed per model as soon as it is done; ``--out`` then holds
``{model}`` (replaced by 0, 1, ...).

It runs through the same engine and code as the evaluation inside a run (megaforge.eval), prints one
JSON line with the same keys as a run's metrics row (``eval/<set>/greedy/pass@1``,
``eval/<set>/sampled/pass@8``, ...; ``samples/<set>``: where its responses went), and writes every
response to ``--out`` (the set name inserted before ``.jsonl`` when there are several sets), by default
beside the run: ``<run>/eval/evaluate/<checkpoint>/<set>.jsonl`` (a run's ``hf/step_N`` export:
``<run>/eval/evaluate/hf_step_N/``; another HF folder: ``<folder>/evaluate/<set>.jsonl``), never into
the working directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time

from common import emit


class EvaluateError(RuntimeError):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=__doc__.split("\n\n")[1])
    p.add_argument("--model", required=True, action="append",
                   help="HF folder, run folder or run checkpoint; repeat it to evaluate several through one engine start")
    p.add_argument("--data", default="", help="prompts to evaluate (default: the run's eval.sets)")
    p.add_argument("--split", default="test", help="split of a `datasets` dataset")
    p.add_argument("--subset", default="", help="configuration of a `datasets` hub dataset")
    p.add_argument("--input_key", default="", help="row key of the prompt (default: data.input_key)")
    p.add_argument("--label_key", default="", help="row key of the answer (default: data.label_key)")
    p.add_argument("--name", default="", help="set name in the metric keys (default: from --data)")
    p.add_argument("--max_rows", type=int, default=0, help="first N prompts only (0: all)")
    p.add_argument("--k", type=int, default=None,
                   help="sampled responses per prompt: pass@1 and pass@k (0: greedy only; default: the run's "
                        "eval.n_samples, else 0)")
    p.add_argument("--no_greedy", action="store_true", help="sampled responses only")
    p.add_argument("--out", default="", help="per-sample jsonl (default: beside the run, <run>/eval/evaluate/...)")
    p.add_argument("--config", default="", help="config YAML (default: the run's config.yaml, if any)")
    p.add_argument("--trust_remote_code", action="store_true",
                   help="allow Python code shipped with a model folder (auto_map) to run; never implied by a config")
    return p.parse_known_args(argv)


# ------------------------------------------------------------------------------ what --model is
def locate(model: str) -> tuple[str, str | None]:
    """(kind, checkpoint): ``("hf", None)`` for an HF folder, ``("checkpoint", path)`` for a run or one
    of its checkpoints (megaforge.handoff_source, which model.path of a run uses too)."""
    from megaforge.handoff_source import SourceError, locate as locate_source

    if not os.path.isdir(model):
        raise EvaluateError(f"--model {model}: no such folder (a hub id cannot be evaluated offline; give a folder)")
    try:
        ckpt = locate_source(model, "--model", log=lambda m: print(m, file=sys.stderr))
    except SourceError as e:
        raise EvaluateError(str(e)) from None
    return ("hf", None) if ckpt is None else ("checkpoint", ckpt)


def run_dir_of(ckpt: str) -> str:
    from megaforge.handoff_source import run_dir_of as of

    return of(ckpt)


def checkpoint_to_hf(ckpt: str, run_cfg, out: str) -> None:
    """The policy weights of a run checkpoint as an HF folder ``out`` (tokenizer included)."""
    from megaforge.handoff_source import SourceError, checkpoint_to_hf as to_hf

    try:
        to_hf(ckpt, run_cfg, out, "--model")
    except SourceError as e:
        raise EvaluateError(str(e)) from None


def out_folder(model: str, ckpt: str | None) -> str:
    """Where the per-sample files go without ``--out``: beside the run (``<run>/eval/evaluate/<checkpoint>``)
    for a run checkpoint or a run's HF export (``<run>/hf/<name>``), else ``<model folder>/evaluate``
    (never the working directory)."""
    if ckpt:
        return os.path.join(run_dir_of(ckpt), "eval", "evaluate", os.path.basename(os.path.normpath(ckpt)))
    model = os.path.abspath(model)
    parent = os.path.dirname(model)
    if os.path.basename(parent) == "hf" and os.path.exists(os.path.join(os.path.dirname(parent), "config.yaml")):
        return os.path.join(os.path.dirname(parent), "eval", "evaluate", "hf_" + os.path.basename(model))
    return os.path.join(model, "evaluate")


# ---------------------------------------------------------------------------------------- config
def remote_code_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys of every ``trust_remote_code`` that is true in a config (dataclasses and lists)."""
    out: list[str] = []
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if f.name == "trust_remote_code":
                out += [prefix + f.name] if value is True else []
            else:
                out += remote_code_keys(value, f"{prefix}{f.name}.")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            out += remote_code_keys(value, f"{prefix.rstrip('.')}[{i}].")
    return out


def refuse_remote_code(cfg, model: str, source: str, allowed: bool) -> None:
    """EvaluateError naming the model and the keys when ``cfg`` trusts remote code and the command
    line did not allow it (``--trust_remote_code``)."""
    keys = remote_code_keys(cfg)
    if keys and not allowed:
        raise EvaluateError(f"--model {model}: {source} sets {', '.join(keys)} true, which would run Python code "
                            f"shipped with a model folder; refused: evaluate trusts remote code only when given "
                            f"--trust_remote_code")


def build_config(args, overrides: list[str], model_dir: str, run_dir: str | None):
    """The evaluation's Config: the base (``--config`` / the run's config.yaml / defaults), the model
    folder, one set from ``--data`` (or the run's sets), and the command line's overrides."""
    import yaml

    from megaforge import configtree
    from megaforge.config import Config

    base = args.config or (os.path.join(run_dir, "config.yaml") if run_dir else "")
    tree: dict = {}
    if base:
        with open(base, "rb") as f:
            try:
                tree = yaml.safe_load(f.read().decode("utf-8")) or {}
            except UnicodeDecodeError as e:
                raise EvaluateError(f"{base}: not valid UTF-8 ({e.reason} at byte offset {e.start})") from None
    tree.setdefault("model", {}).update(path=model_dir, config="", tokenizer="")
    tree["max_steps"] = 0
    ev = tree.setdefault("eval", {})
    if args.data:
        name = args.name or os.path.splitext(os.path.basename(os.path.normpath(args.data)))[0] or "data"
        ev["sets"] = [{"name": "".join(c if c.isalnum() or c in "_.-" else "_" for c in name), "path": args.data,
                       "split": args.split, "subset": args.subset, "input_key": args.input_key,
                       "label_key": args.label_key, "max_rows": args.max_rows}]
    elif args.max_rows:
        for s in ev.get("sets", []):
            s["max_rows"] = args.max_rows
    if args.trust_remote_code:
        tree["model"]["trust_remote_code"] = True
    ev.update(before_train=True, interval=0, greedy=not args.no_greedy, write_samples=False)
    if args.k is not None:
        ev.update(n_samples=args.k, pass_k=sorted({1, args.k}) if args.k else [])
    if not (tree.get("data") or {}).get("path"):
        ev["check_disjoint"] = False  # no training data is known: nothing to be disjoint from
    _, cli = configtree.parse_cli(overrides)
    configtree.check_keys(Config, cli)
    for k, v in cli.items():
        configtree.set_dotted(tree, k, v)
    cfg = configtree.build(Config, tree)
    if not cfg.eval.sets:
        raise EvaluateError("nothing to evaluate: give --data (the run has no eval.sets)")
    return cfg


#: config.json keys a further ``--model`` must share with the first (the engine keeps its shapes)
SAME_ARCH = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings", "num_experts",
             "moe_intermediate_size")


def check_same_arch(first: str, other: str) -> None:
    """EvaluateError naming the key and both folders when ``other``'s config.json differs from ``first``'s
    in a key of :data:`SAME_ARCH`."""
    import json

    def read(folder):
        try:
            with open(os.path.join(folder, "config.json")) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise EvaluateError(f"--model {folder}: cannot read its config.json ({e})") from None

    a, b = read(first), read(other)
    for k in SAME_ARCH:
        if a.get(k) != b.get(k):
            raise EvaluateError(f"--model {other}: config.json {k} = {b.get(k)!r}, but the engine serves the first "
                                f"--model {first} with {a.get(k)!r}: evaluate models of one architecture together")


def hf_buckets(folder: str, dtype, device, bucket_bytes: int = 512 << 20):
    """The tensors of HF folder ``folder`` (megaforge.convert.mapping.HFSource: its safetensors, index or
    single file), floating ones cast to ``dtype``, on ``device``, in buckets of at most ``bucket_bytes``
    (megaforge.sync.adapters.byte_buckets: the shape of a run's sync)."""
    from megaforge.convert.mapping import HFSource
    from megaforge.sync.adapters import byte_buckets

    try:
        src = HFSource(folder)
    except FileNotFoundError as e:
        raise EvaluateError(f"--model {folder}: {e} (a further --model reaches the running engine from its "
                            f"safetensors files)") from None

    def one(name):
        t = src(name)
        return [(name, t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device))]

    return byte_buckets((one(name) for name in src.names()), bucket_bytes)


def evaluate(cfg, models: list) -> None:
    """Each of ``models`` (``[(weights_dir_fn, out_path_fn, extra)]``; ``weights_dir_fn()`` gives the HF
    folder, a checkpoint converted on demand) through one engine started on ``cfg.model.path`` (the first's):
    one JSON line each, printed when done."""
    import torch

    from megaforge.build import RunBuilder
    from megaforge.eval.runner import write_jsonl
    from megaforge.hf import load_tokenizer
    from megaforge.rewards import RewardManager
    from megaforge.rollout import build_engine
    from megaforge.rollout.manager import stop_token_ids

    b = RunBuilder(cfg)
    b.preflight()
    tok = load_tokenizer(cfg.model)
    sets, _ = b.eval_sets(tok)
    rewards = RewardManager(cfg.rewards)
    engine = build_engine(b.engine_spec(), tok)
    try:
        ev = b.evaluator(None, sets, tok, rewards, stop_token_ids(tok, cfg.model.path))
        dtype = getattr(torch, cfg.engine_dtype)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for i, (weights_dir, out_path, extra) in enumerate(models):
            t0 = time.perf_counter()
            if i:
                folder = weights_dir()
                check_same_arch(cfg.model.path, folder)
                engine.update_weights(hf_buckets(folder, dtype, device), version=i)
                if engine.weight_version != i:
                    raise EvaluateError(f"--model {folder}: the engine reports weight version {engine.weight_version} "
                                        f"after the update to {i}")
            out: dict = {}
            for s in sets:
                metrics, records = ev.evaluate_set(engine, s, step=0)
                out.update({f"eval/{s.name}/{k}": v for k, v in metrics.items()})
                path = out_path(s.name, len(sets))
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                write_jsonl(path, records)
                out[f"samples/{s.name}"] = os.path.abspath(path)
            emit({**extra, "engine": cfg.rollout.engine, **out, "weight_version": i,
                  "time_s": round(time.perf_counter() - t0, 2)})
    finally:
        engine.shutdown()
        rewards.close()


def out_path_fn(out_arg: str, model: str, ckpt, index: int, several: bool):
    """(set name, number of sets) -> the per-sample file of one model (see the module docstring)."""
    if several and out_arg and "{model}" not in out_arg:
        raise EvaluateError(f"--out {out_arg}: with several --model it must hold {{model}} (replaced by 0, 1, ...)")
    out_arg = out_arg.replace("{model}", str(index))

    def path(set_name: str, n_sets: int) -> str:
        if not out_arg:
            return os.path.join(out_folder(model, ckpt), f"{set_name}.jsonl")
        return f"{os.path.splitext(out_arg)[0]}_{set_name}.jsonl" if n_sets > 1 else out_arg

    return path


def prepare(model: str, args, tmps: list):
    """(a function giving the HF folder, converting a checkpoint on demand; checkpoint; run dir) of one
    ``--model``."""
    _, ckpt = locate(model)
    run_dir = run_dir_of(ckpt) if ckpt else None
    if not ckpt:
        return (lambda: os.path.abspath(model)), ckpt, run_dir
    from megaforge.config import load_config

    if not os.path.exists(os.path.join(run_dir, "config.yaml")):
        raise EvaluateError(f"{ckpt}: no config.yaml in its run folder {run_dir}")
    run_cfg = load_config(["--config", os.path.join(run_dir, "config.yaml")])
    refuse_remote_code(run_cfg, model, os.path.join(run_dir, "config.yaml"), args.trust_remote_code)

    def convert() -> str:
        tmp = tempfile.mkdtemp(prefix="megaforge-evaluate-")
        tmps.append(tmp)
        checkpoint_to_hf(ckpt, run_cfg, os.path.join(tmp, "hf"))
        return os.path.join(tmp, "hf")

    return convert, ckpt, run_dir


def main(argv=None) -> int:
    from megaforge.configtree import ConfigError
    from megaforge.data.sources import DataError

    args, overrides = parse_args(argv)
    tmps: list = []
    try:
        prepared = [prepare(m, args, tmps) for m in args.model]  # every --model found before the engine starts
        first, ckpt, run_dir = prepared[0]
        cfg = build_config(args, overrides, first(), run_dir)
        base = args.config or (os.path.join(run_dir, "config.yaml") if run_dir else "the defaults")
        refuse_remote_code(cfg, args.model[0], f"the evaluation's config ({base} and the command line)",
                           args.trust_remote_code)
        several = len(args.model) > 1
        models = [(fn, out_path_fn(args.out, m, c, i, several),
                   {"model": os.path.abspath(m), "weights": os.path.basename(c) if c else "hf"})
                  for i, (m, (fn, c, _)) in enumerate(zip(args.model, prepared))]
        evaluate(cfg, models)
    except (EvaluateError, ConfigError, DataError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a model / tokenizer / data path that does not resolve from here
        print(f"evaluate: error: {e} (a run's config.yaml holds paths relative to the folder the run was "
              f"started from: run this tool from there)", file=sys.stderr)
        return 1
    finally:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
