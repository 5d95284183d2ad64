#!/usr/bin/env python
"""The prompts megaforge's prompt source visits, in its order, written for the peers (issue 39).

    python tools/peers/peer_data.py --config configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml --steps 60 --out_dir /tmp/peers/data \
        [--model.path /tmp/qwen2.5-coder-0.5b-instruct ...any megaforge config override]

megaforge's own :class:`megaforge.data.prompts.PromptSource` is built as the run builds it (the config's
data section, the run's seed, the prompts the eval sets hold out of data.path left out) and asked for
``rollout.batch_size`` prompts ``--steps`` times: row ``k`` of the output is the ``k``-th prompt the run
trains on (step ``k // batch_size + 1``), epochs past the first included, whatever the shuffle. Written:

* ``train.parquet`` (verl 0.9.1's RL dataset): ``{data_source, prompt: [system?, user messages], ability,
  reward_model: {style: rule, ground_truth}, extra_info: {index, step, where}}``; read with
  ``data.shuffle=False`` (a sequential sampler) and ``train_batch_size`` = ``rollout.batch_size``, verl's
  step ``s`` gets the same prompts as megaforge's step ``s``.
* ``test.parquet``: each eval set's rows in file order, same format (verl's own validation, a cross-check).
* ``train.jsonl``: ``{prompt: messages, answer, step, where}`` for TRL (conversational prompts, read in
  order with ``shuffle_dataset=False``).
* ``order.json``: the config, seed, batch size, steps and the ``where`` (file:line) of every row.

Each row's messages are checked to render, through the tokenizer's chat template with the generation
prompt (what verl and TRL do), to exactly the prompt text megaforge gives its engine; a mismatch is an
error naming the row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

DATA_SOURCE = "gsm8k"  # verl's reward_fn_key value; compute_score ignores it (megaforge's math reward for every row)


def messages_of(content, system_prompt: str) -> list[dict]:
    """The chat messages megaforge renders for a prompt field (megaforge.data.prompts.chat_text)."""
    msgs = list(content) if isinstance(content, list) else [{"role": "user", "content": content}]
    if system_prompt and not any(m.get("role") == "system" for m in msgs):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def _raw_by_where(data_cfg, seed: int) -> dict:
    from megaforge.data.sources import read_rows
    return {r.where: r.data for r in read_rows(data_cfg, seed)}


def ordered_rows(cfg, tokenizer, steps: int) -> list[dict]:
    """The first ``steps * rollout.batch_size`` prompts of megaforge's prompt source, in order, each
    ``{messages, label, step, where, prompt_text}``."""
    from megaforge.data.prompts import PromptSource
    from megaforge.data.sources import DataError
    from megaforge.build import RunBuilder

    _, held = RunBuilder(cfg).eval_sets(tokenizer) if cfg.eval.sets else ([], frozenset())
    source = PromptSource(cfg.data, tokenizer, cfg.seed, exclude=held)
    raw = _raw_by_where(cfg.data, cfg.seed)
    out = []
    for s in range(1, steps + 1):
        for row in source.next_batch(cfg.rollout.batch_size):
            data = raw.get(row.where)
            if data is None:
                raise DataError(f"{row.where}: the prompt source gave a row that the reader did not")
            msgs = messages_of(data[cfg.data.input_key], cfg.data.system_prompt)
            if cfg.data.apply_chat_template:
                text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                if text != row.prompt_text:
                    raise DataError(f"{row.where}: the chat template renders the messages differently from "
                                    f"megaforge's prompt ({text[:80]!r} vs {row.prompt_text[:80]!r})")
            out.append({"messages": msgs, "label": row.label, "step": s, "where": row.where,
                        "prompt_text": row.prompt_text})
    return out


def eval_rows(cfg, tokenizer) -> list[dict]:
    """The eval sets' rows in file order, as :func:`ordered_rows` gives them (step 0)."""
    from megaforge.build import RunBuilder
    from megaforge.eval.sets import set_data_config

    sets, _ = RunBuilder(cfg).eval_sets(tokenizer)
    out = []
    for spec, es in zip(cfg.eval.sets, sets):
        dcfg = set_data_config(cfg.data, spec)
        raw = _raw_by_where(dcfg, cfg.seed)
        for row in es.rows:
            msgs = messages_of(raw[row.where][dcfg.input_key], dcfg.system_prompt)
            out.append({"messages": msgs, "label": row.label, "step": 0, "where": row.where, "set": es.name,
                        "prompt_text": row.prompt_text})
    return out


def verl_record(r: dict, index: int, split: str) -> dict:
    return {"data_source": DATA_SOURCE, "prompt": r["messages"], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(r["label"])},
            "extra_info": {"index": index, "step": r["step"], "where": r["where"], "split": split}}


def write_parquet(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="RL steps of prompts to write")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--no_eval", action="store_true", help="skip test.parquet")
    a, rest = p.parse_known_args(argv)
    from megaforge.config import ConfigError, load_config
    from megaforge.data.sources import DataError
    from megaforge.hf import load_tokenizer
    if a.steps < 1:
        print("megaforge: error: --steps must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = load_config(rest)
        tok = load_tokenizer(cfg.model)
        rows = ordered_rows(cfg, tok, a.steps)
        evals = [] if a.no_eval or not cfg.eval.sets else eval_rows(cfg, tok)
    except ConfigError as e:
        print(f"megaforge: config error: {e}", file=sys.stderr)
        return 2
    except (DataError, OSError, ValueError) as e:
        print(f"megaforge: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(a.out_dir, exist_ok=True)
    write_parquet([verl_record(r, i, "train") for i, r in enumerate(rows)], os.path.join(a.out_dir, "train.parquet"))
    if evals:
        write_parquet([verl_record(r, i, "test") for i, r in enumerate(evals)], os.path.join(a.out_dir, "test.parquet"))
    with open(os.path.join(a.out_dir, "train.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["messages"], "answer": str(r["label"]), "step": r["step"],
                                "where": r["where"]}) + "\n")
    with open(os.path.join(a.out_dir, "order.json"), "w") as f:
        json.dump({"data": cfg.data.path, "seed": cfg.seed, "batch_size": cfg.rollout.batch_size, "steps": a.steps,
                   "where": [r["where"] for r in rows]}, f)
    print(json.dumps({"out_dir": a.out_dir, "train_rows": len(rows), "test_rows": len(evals), "steps": a.steps,
                      "batch_size": cfg.rollout.batch_size, "first": rows[0]["where"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
