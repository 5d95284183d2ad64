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
import itertools
from dataclasses import dataclass
from typing import Sequence

from megaforge.data.holdout import choose_held_out
from megaforge.data.prompts import PromptRow, parse_row, row_keys
from megaforge.data.sources import DataError, JsonlIndex, RawRow, read_rows, row_table


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


def _where(table: Sequence[RawRow], i: int) -> str:
    return table.where(i) if isinstance(table, JsonlIndex) else table[i].where


@dataclass
class _Training:
    """A source the run trains on: its rows, their prompt digests, and digests it leaves out."""
    rows: Sequence[RawRow]
    keys: Sequence[int]
    left_out: frozenset = frozenset()


def load_eval_sets(eval_cfg, data_cfg, seed: int, tokenizer, sft_data=None) -> tuple[list[EvalSet], frozenset]:
    """The sets of ``eval_cfg`` (the ``eval`` section) and the digests of the prompts held out of
    data.path (``data_cfg``: the ``data`` section; empty without a holdout set;
    megaforge.data.prompts.row_keys). ``sft_data``: the SFT data the run trains on (``sft.data`` when
    ``sft.max_steps`` > 0), checked disjoint from the sets too. Raises DataError naming the set and row
    for a bad row or a prompt shared with training. data.path is indexed and its prompts keyed once
    (megaforge.data.sources.row_table), for the split and the training data alike."""
    if not eval_cfg.sets:
        return [], frozenset()
    held = frozenset()
    hold = next((s for s in eval_cfg.sets if not s.path), None)
    data_rows, data_keys = None, None
    if hold is not None or eval_cfg.check_disjoint:
        data_rows = row_table(data_cfg, seed)
        data_keys = row_keys(data_rows, data_cfg, tokenizer)
    if hold is not None:
        try:
            held = choose_held_out(data_keys, hold.holdout, seed)
        except ValueError as e:
            raise DataError(f"eval set {hold.name!r} (holdout {hold.holdout} of data.path {data_cfg.path!r}): "
                            f"{e}") from None
    training = []
    if eval_cfg.check_disjoint:
        training.append(_Training(data_rows, data_keys, held))
        if sft_data is not None:
            sft_rows = row_table(sft_data, seed)
            training.append(_Training(sft_rows, row_keys(sft_rows, sft_data, tokenizer)))
    sets = []
    for s in eval_cfg.sets:
        dcfg = set_data_config(data_cfg, s)
        if s.path:
            raw = list(itertools.islice(read_rows(dcfg, seed), s.max_rows or None))
        else:  # one row per held-out prompt, in data order (the first max_rows of them)
            seen: set[int] = set()
            raw = []
            for i, k in enumerate(data_keys):
                if k in held and k not in seen and len(raw) < (s.max_rows or len(held)):
                    seen.add(k)
                    raw.append(data_rows[i])
        if not raw:
            raise DataError(f"eval set {s.name!r} ({dcfg.path!r}): no rows")
        rows = []
        for r in raw:
            try:
                rows.append(parse_row(r, dcfg, tokenizer, want_response=False))
            except DataError as e:
                raise DataError(f"eval set {s.name!r}: {e}") from None
        if eval_cfg.check_disjoint:
            _check_disjoint(s.name, raw, row_keys(raw, dcfg, tokenizer), training)
        sets.append(EvalSet(s.name, rows, dcfg.path if s.path else f"{hold.holdout} of {data_cfg.path}"))
    return sets, held


def _check_disjoint(name: str, raw: list[RawRow], keys: Sequence[int], training: list[_Training]) -> None:
    """DataError when a row of the set has a training prompt: the set's keys are a small set, the
    training sources' digests are scanned once each (no set of every training prompt is built)."""
    mine = {k for k in keys if k}
    first: dict[int, str] = {}  # set prompt -> the first training row that has it
    for t in training:
        for i, k in enumerate(t.keys):
            if k in mine and k not in first and k not in t.left_out:
                first[k] = _where(t.rows, i)
    shared = [(r.where, first[k]) for r, k in zip(raw, keys) if k in first]
    if shared:
        where, trained = shared[0]
        raise DataError(f"eval set {name!r}: row {where} has the same prompt as training row {trained} "
                        f"({len(shared)} of its {len(raw)} rows are training prompts); held-out prompts must not "
                        f"be trained on: remove them, or hold out of data.path (eval.sets[].holdout); to score training prompts on "
                        f"purpose, --eval.check_disjoint false")
