"""Held-out evaluation sets (``eval.sets``): loading, the held-out part of ``data.path``, and the check
that no evaluation prompt is a training prompt.

A set is a file / folder / `datasets` split (``path``), or a fraction of data.path's distinct prompts
(``holdout``, chosen with the run's seed; those prompts then leave the RL and SFT data). Rows are
validated and formatted exactly like training prompts (:func:`megaforge.data.prompts.parse_row`, with
data's chat template, system prompt and length limit), so a bad row is an error naming its file and
row. With ``eval.check_disjoint`` every set is compared with the training prompts (data.path less the
held-out part, and sft.data when the warm start runs), in one normal form of what the model sees
(:mod:`megaforge.data.holdout`): a shared prompt is an error naming the set,
its row and the training row.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megaforge.data.holdout import choose_held_out, prompt_key
from megaforge.data.prompts import PromptRow, parse_row, prompt_renderer
from megaforge.data.sources import DataError, RawRow, read_rows


@dataclass
class EvalSet:
    name: str
    rows: list[PromptRow]
    source: str  # what it was read from, for messages


def set_data_config(data_cfg, s):
    """The DataConfig that reads set ``s``: data's prompt formatting with the set's source and keys."""
    return dataclasses.replace(
        data_cfg, path=s.path or data_cfg.path, format=s.format if s.path else data_cfg.format,
        split=s.split if s.path else data_cfg.split, name=s.subset if s.path else data_cfg.name,
        input_key=s.input_key or data_cfg.input_key, label_key=s.label_key or data_cfg.label_key,
        streaming=False, shuffle=False, skip_bad_rows=False)


def _key(r: RawRow, dcfg, render) -> Optional[str]:
    """The row's prompt key (what the model sees, in normal form: megaforge.data.holdout)."""
    return prompt_key(r.data.get(dcfg.input_key), render) if r.data is not None else None


def _keys(rows: list[RawRow], dcfg, tokenizer) -> dict[str, str]:
    """{prompt key: where of its first row} of the rows that have a prompt."""
    out: dict[str, str] = {}
    render = prompt_renderer(tokenizer, dcfg)
    for r in rows:
        k = _key(r, dcfg, render)
        if k is not None:
            out.setdefault(k, r.where)
    return out


def _training_keys(cfg, tokenizer, data_rows: Optional[list[RawRow]], held: frozenset) -> dict[str, str]:
    """Prompt keys of everything the run trains on: data.path less the held-out prompts, and sft.data."""
    rows = data_rows if data_rows is not None else list(read_rows(cfg.data, cfg.seed))
    keys = {k: w for k, w in _keys(rows, cfg.data, tokenizer).items() if k not in held}
    if cfg.sft.max_steps > 0 and cfg.sft.data is not None:
        for k, w in _keys(list(read_rows(cfg.sft.data, cfg.seed)), cfg.sft.data, tokenizer).items():
            keys.setdefault(k, w)
    return keys


def load_eval_sets(cfg, tokenizer) -> tuple[list[EvalSet], frozenset]:
    """The configured sets and the prompt keys held out of data.path (empty without a holdout set).
    Raises DataError naming the set and row for a bad row or a prompt shared with training."""
    if not cfg.eval.sets:
        return [], frozenset()
    data_rows, held = None, frozenset()
    hold = next((s for s in cfg.eval.sets if not s.path), None)
    if hold is not None:
        data_rows = list(read_rows(cfg.data, cfg.seed))
        try:
            held = choose_held_out(_keys(data_rows, cfg.data, tokenizer), hold.holdout, cfg.seed)
        except ValueError as e:
            raise DataError(f"eval set {hold.name!r} (holdout {hold.holdout} of data.path {cfg.data.path!r}): "
                            f"{e}") from None
    train = _training_keys(cfg, tokenizer, data_rows, held) if cfg.eval.check_disjoint else {}
    sets = []
    for s in cfg.eval.sets:
        dcfg = set_data_config(cfg.data, s)
        render = prompt_renderer(tokenizer, dcfg)
        if s.path:
            raw = list(read_rows(dcfg, cfg.seed))
        else:  # one row per held-out prompt, in data order
            seen: set[str] = set()
            raw = []
            for r in data_rows:
                k = _key(r, dcfg, render)
                if k in held and k not in seen:
                    seen.add(k)
                    raw.append(r)
        if s.max_rows:
            raw = raw[: s.max_rows]
        if not raw:
            raise DataError(f"eval set {s.name!r} ({dcfg.path!r}): no rows")
        rows = []
        for r in raw:
            try:
                rows.append(parse_row(r, dcfg, tokenizer, want_response=False))
            except DataError as e:
                raise DataError(f"eval set {s.name!r}: {e}") from None
        if cfg.eval.check_disjoint:
            _check_disjoint(s.name, raw, dcfg, render, train)
        sets.append(EvalSet(s.name, rows, dcfg.path if s.path else f"{hold.holdout} of {cfg.data.path}"))
    return sets, held


def _check_disjoint(name: str, raw: list[RawRow], dcfg, render, train: dict[str, str]) -> None:
    shared = [(r.where, train[k]) for r in raw if (k := _key(r, dcfg, render)) in train]
    if shared:
        where, trained = shared[0]
        raise DataError(f"eval set {name!r}: row {where} has the same prompt as training row {trained} "
                        f"({len(shared)} of its {len(raw)} rows are training prompts); held-out prompts must not "
                        f"be trained on: remove them, or hold out of data.path (eval.sets[].holdout)")
