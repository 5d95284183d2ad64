"""Row sources: jsonl, parquet, `datasets` datasets (local or hub, map-style or streaming), synthetic.

Every row comes with a *location* string (``file.jsonl:17``, ``data.parquet:row 3``,
``dataset[train]:row 5``) so that a malformed row can be named in the error.

Map-style data of ``.jsonl`` files is a :class:`JsonlIndex` (:func:`row_table`): one pass records
each row's file, byte offset, length and line number (about 20 bytes a row, whatever the row's
size), and a row is read (``pread``) and parsed when it is asked for, so memory does not grow with
the rows' contents. An index is kept per file identity (path, size, mtime) for the process
(:data:`INDEX_CACHE_SIZE` of them), so the held-out split and the training data scan ``data.path``
once. ``.json`` lists, parquet, `datasets` and synthetic sources are read into a list.
"""
from __future__ import annotations

import glob
import json
import os
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from megaforge.data.synthetic import SYNTHETIC_TASKS, synthetic_rows


class DataError(ValueError):
    """A malformed data row or an unreadable data source; the message names file and row."""


@dataclass
class RawRow:
    data: Optional[dict]  # None when the row could not be parsed
    where: str  # file and row number
    error: str = ""  # why the row could not be parsed


def detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if os.path.isdir(path):
        files = os.listdir(path)
        if any(f.endswith(".jsonl") for f in files):
            return "jsonl"
        if any(f.endswith(".parquet") for f in files):
            return "parquet"
        return "hf"  # a saved `datasets` dataset or a dataset script folder
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    if os.path.exists(path):
        raise DataError(f"data.path {path!r}: cannot tell the format from the name; set data.format")
    if path in SYNTHETIC_TASKS:
        return "synthetic"
    return "hf"  # a hub dataset name


def _files(path: str, ext: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, f"**/*{ext}"), recursive=True))
        if not files:
            raise DataError(f"data.path {path!r}: no *{ext} files in the directory")
        return files
    if not os.path.exists(path):
        raise DataError(f"data.path {path!r}: no such file")
    return [path]


def _loads(text: str) -> tuple[Any, str]:
    """(value, "") or (None, why the text is not a JSON value we can read)."""
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except RecursionError:  # e.g. 100,000 nested brackets
        return None, f"nested deeper than the JSON reader allows (Python's recursion limit {sys.getrecursionlimit()})"


def read_jsonl(path: str) -> Iterator[RawRow]:
    """Rows of .jsonl files (one JSON object a line; a line that is not UTF-8 or not valid JSON is
    a bad row named ``file:line``) or of .json files (a list of objects; an unreadable file is a
    DataError naming it)."""
    for f in _files(path, ".jsonl") if os.path.isdir(path) else _files(path, ""):
        with open(f, "rb") as fh:
            if f.endswith(".json"):
                data = fh.read()
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{f}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
                items, why = _loads(text)
                if why:
                    raise DataError(f"{f}: {why}")
                if not isinstance(items, list):
                    raise DataError(f"{f}: a .json data file must hold a list of rows")
                for i, item in enumerate(items):
                    yield _as_row(item, f"{f}:item {i}")
                continue
            for lineno, raw in enumerate(fh, 1):
                if raw.strip():
                    yield parse_line(raw, f"{f}:{lineno}")


def parse_line(raw: bytes, where: str) -> RawRow:
    """One jsonl line as a row (a bad row, naming ``where``, when it is not UTF-8 or not a JSON object)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRow(None, where, f"not valid UTF-8 ({e.reason} at byte {e.start} of the line)")
    item, why = _loads(line)
    return RawRow(None, where, why) if why else _as_row(item, where)


@dataclass(eq=False)
class JsonlIndex(Sequence):
    """The rows of ``.jsonl`` files by position: (file, byte offset, length, line) of each non-blank
    line, recorded in one pass; ``index[i]`` reads and parses row ``i`` (:func:`parse_line`).
    ``memo`` holds what callers derive from every row once (e.g. prompt keys, megaforge.data.prompts)."""

    files: list[str]
    file_of: array = field(default_factory=lambda: array("I"))
    offset: array = field(default_factory=lambda: array("q"))
    length: array = field(default_factory=lambda: array("I"))
    line: array = field(default_factory=lambda: array("I"))
    memo: dict = field(default_factory=dict)
    _fd: tuple = (-1, -1)  # (file number, open descriptor) of the last file read

    @classmethod
    def scan(cls, files: list[str]) -> "JsonlIndex":
        index = cls(list(files))
        for fi, f in enumerate(index.files):
            with open(f, "rb") as fh:
                pos = 0
                for lineno, raw in enumerate(fh, 1):
                    if raw.strip():
                        index.file_of.append(fi)
                        index.offset.append(pos)
                        index.length.append(len(raw))
                        index.line.append(lineno)
                    pos += len(raw)
        return index

    def __len__(self) -> int:
        return len(self.offset)

    def where(self, i: int) -> str:
        return f"{self.files[self.file_of[i]]}:{self.line[i]}"

    def __getitem__(self, i: int) -> RawRow:
        fi = self.file_of[i]
        if self._fd[0] != fi:
            self.close()
            self._fd = (fi, os.open(self.files[fi], os.O_RDONLY | os.O_CLOEXEC))
        raw = os.pread(self._fd[1], self.length[i], self.offset[i])
        if len(raw) != self.length[i]:
            raise DataError(f"{self.where(i)}: the file changed while it was read (the row is cut short)")
        return parse_line(raw, self.where(i))

    def close(self) -> None:
        if self._fd[1] >= 0:
            os.close(self._fd[1])
        self._fd = (-1, -1)

    def __del__(self):
        self.close()


INDEX_CACHE_SIZE = 4
# A cache, not run state: keyed by every file's (path, size, mtime), so an index is what a fresh scan would give
# whoever asks (the train data and eval sets of a run, a second run in the same process).
_INDEXES: "OrderedDict[tuple, JsonlIndex]" = OrderedDict()


def jsonl_index(files: list[str]) -> JsonlIndex:
    """The :class:`JsonlIndex` of ``files``, scanned once per (path, size, mtime) of every file."""
    ident = tuple((os.path.abspath(f), st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])
    if ident in _INDEXES:
        _INDEXES.move_to_end(ident)
        return _INDEXES[ident]
    index = _INDEXES[ident] = JsonlIndex.scan(files)
    while len(_INDEXES) > INDEX_CACHE_SIZE:
        _INDEXES.popitem(last=False)
    return index


def row_table(cfg, seed: int) -> Union[JsonlIndex, list]:
    """Map-style rows of a DataConfig: a :class:`JsonlIndex` for ``.jsonl`` data, else every row in a list."""
    if detect_format(cfg.path, cfg.format) == "jsonl":
        files = _files(cfg.path, ".jsonl") if os.path.isdir(cfg.path) else _files(cfg.path, "")
        if not any(f.endswith(".json") for f in files):
            return jsonl_index(files)
    return list(read_rows(cfg, seed))


def _as_row(item: Any, where: str) -> RawRow:
    if not isinstance(item, dict):
        return RawRow(None, where, f"a row must be a JSON object, got {type(item).__name__}")
    return RawRow(item, where)


def read_parquet(path: str) -> Iterator[RawRow]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError("reading parquet needs pyarrow (pip install 'megaforge[data]')") from e
    for f in _files(path, ".parquet"):
        try:
            table = pq.read_table(f)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{f}: cannot read parquet: {e}") from None
        for i, item in enumerate(table.to_pylist()):
            yield _as_row(item, f"{f}:row {i}")


def read_hf(path: str, split: str, streaming: bool, name: str = "") -> Iterator[RawRow]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"data.path {path!r} is a `datasets` dataset: pip install datasets") from e
    try:
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            ds = datasets.load_from_disk(path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            ds = datasets.load_from_disk(path)[split]
        else:
            ds = datasets.load_dataset(path, name or None, split=split, streaming=streaming)
    except Exception as e:
        subset = f", data.name {name!r}" if name else ""
        raise DataError(f"data.path {path!r} (split {split!r}{subset}): cannot load dataset: {e}") from None
    for i, item in enumerate(ds):
        yield _as_row(dict(item), f"{path}[{split}]:row {i}")


def read_synthetic(name: str, n: int, seed: int, kwargs: dict) -> Iterator[RawRow]:
    """Rows of the generated task ``name`` (data.format synthetic); a file or folder there, or an
    unknown task, is a DataError naming data.format and data.path and what to set."""
    if os.path.exists(name):
        try:
            fmt = detect_format(name, "auto")
        except DataError:
            fmt = "jsonl"  # a file whose name tells nothing: the usual prompt file
        raise DataError(f"data.format 'synthetic' generates a task named by data.path, but data.path {name!r} is "
                        f"a {'folder' if os.path.isdir(name) else 'file'}: set --data.format {fmt} (or auto) "
                        f"to read it")
    try:
        rows = synthetic_rows(name, n, seed, **kwargs)
    except ValueError as e:
        raise DataError(f"data.format 'synthetic', data.path {name!r}: {e}; for a file of prompts set "
                        f"--data.format jsonl / parquet / hf") from None
    for i, item in enumerate(rows):
        yield RawRow(item, f"{name}:row {i}")


def read_rows(cfg, seed: int) -> Iterator[RawRow]:
    """All rows of the source described by a DataConfig."""
    fmt = detect_format(cfg.path, cfg.format)
    if fmt == "jsonl":
        return read_jsonl(cfg.path)
    if fmt == "parquet":
        return read_parquet(cfg.path)
    if fmt == "hf":
        return read_hf(cfg.path, cfg.split, cfg.streaming, cfg.name)
    if fmt == "synthetic":
        return read_synthetic(cfg.path, cfg.synthetic_size, seed, cfg.synthetic_kwargs)
    raise DataError(f"data.format {fmt!r} is not supported")
