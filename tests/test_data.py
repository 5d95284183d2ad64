import json

import pytest

from megaforge.config import DataConfig
from megaforge.data.prompts import PromptSource
from megaforge.data.sources import DataError


def _cfg(path, **kw):
    return DataConfig(path=path, **kw)


def _write_jsonl(p, rows):
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_jsonl_rows_and_chat_template(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": "What is 1 + 2?", "answer": "3"}, {"prompt": "What is 2 + 2?", "answer": "4"}])
    src = PromptSource(_cfg(str(p), shuffle=False), tokenizer, seed=0)
    rows = src.next_batch(2)
    assert rows[0].prompt_text == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert rows[0].label == "3" and rows[1].label == "4"
    assert tokenizer.decode(rows[0].prompt_ids) == rows[0].prompt_text


def test_malformed_row_names_file_and_line(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": "a", "answer": "1"}, "{not json", {"prompt": "b", "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid JSON"):
        PromptSource(_cfg(str(p), shuffle=False), tokenizer, 0).next_batch(3)


def test_missing_field_names_row_and_key(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'prompt' \(data.input_key\)"):
        PromptSource(_cfg(str(p), shuffle=False), tokenizer, 0).next_batch(2)


def test_skip_bad_rows_counts(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": "a", "answer": "1"}, "[1, 2]", {"prompt": "", "answer": "2"}, {"prompt": "c", "answer": "3"}])
    src = PromptSource(_cfg(str(p), shuffle=False, skip_bad_rows=True), tokenizer, 0)
    rows = src.next_batch(2)
    assert [r.label for r in rows] == ["1", "3"] and src.skipped == 2


def test_prompt_too_long(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": "x " * 200, "answer": "1"}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: prompt has \d+ tokens > data.max_prompt_len 32"):
        PromptSource(_cfg(str(p), max_prompt_len=32), tokenizer, 0).next_batch(1)


def test_parquet_and_custom_keys(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2", None], "gold": ["1", "2", "3"]}), p)
    src = PromptSource(_cfg(str(p), input_key="question", label_key="gold", shuffle=False), tokenizer, 0)
    assert [r.label for r in src.next_batch(2)] == ["1", "2"]
    with pytest.raises(DataError, match=r"d\.parquet:row 2: field 'question' must be a non-empty string"):
        src.next_batch(1)


def test_messages_rows_and_system_prompt(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
                     {"prompt": [{"role": "user"}], "answer": "2"}])
    src = PromptSource(_cfg(str(p), shuffle=False, system_prompt="Be brief."), tokenizer, 0)
    r = src.next_batch(1)[0]
    assert r.prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    with pytest.raises(DataError, match=r"d\.jsonl:2: prompt\[0\] must be"):
        src.next_batch(1)


def test_resume_position_reproduces_order(tokenizer):
    cfg = _cfg("arithmetic", format="synthetic", synthetic_size=50)
    a = PromptSource(cfg, tokenizer, seed=3)
    first = [r.prompt_text for r in a.next_batch(30)]
    state = a.state_dict()
    rest = [r.prompt_text for r in a.next_batch(40)]  # crosses an epoch boundary
    b = PromptSource(cfg, tokenizer, seed=3)
    b.load_state_dict(state)
    assert [r.prompt_text for r in b.next_batch(40)] == rest
    assert a.epoch == 1 and first != rest[:30]


def test_unknown_synthetic_task_lists_registered(tokenizer):
    with pytest.raises(DataError, match="data.format 'synthetic', data.path 'algebra': unknown synthetic task "
                                        "'algebra'; registered: arithmetic.*set --data.format jsonl"):
        PromptSource(_cfg("algebra", format="synthetic"), tokenizer, 0)


@pytest.mark.parametrize("name,fmt", [("my.jsonl", "jsonl"), ("my.parquet", "parquet"), ("prompts", "jsonl")])
def test_synthetic_format_with_a_file_path_says_what_to_set(tmp_path, tokenizer, name, fmt):
    """Issue 40: ``--data.format synthetic`` with a file path was a traceback (a ValueError of the
    task registry): a DataError (one ``megaforge: error:`` line) naming both keys and the format."""
    p = tmp_path / name
    p.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=f"data.format 'synthetic' .* data.path '{p}' is a file: set --data.format "
                                        f"{fmt} \\(or auto\\)"):
        PromptSource(_cfg(str(p), format="synthetic"), tokenizer, 0)


def test_sft_rows_need_response(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": "a", "response": "b"}, {"prompt": "a"}])
    src = PromptSource(_cfg(str(p), shuffle=False), tokenizer, 0, want_response=True)
    assert tokenizer.decode(src.next_batch(1)[0].response_ids) == "b"
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing or empty field 'response'"):
        src.next_batch(1)


def test_hf_datasets_saved_and_streaming(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = {"prompt": [f"What is {i} + 1?" for i in range(6)], "answer": [str(i + 1) for i in range(6)]}
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(rows).save_to_disk(str(saved))
    src = PromptSource(_cfg(str(saved), format="hf", shuffle=False), tokenizer, 0)
    assert [r.label for r in src.next_batch(3)] == ["1", "2", "3"]

    pq_dir = tmp_path / "pq"
    pq_dir.mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(pq_dir / "train.parquet"))
    stream = PromptSource(_cfg(str(pq_dir), format="hf", streaming=True), tokenizer, 0)
    got = [r.label for r in stream.next_batch(4)]
    state = stream.state_dict()
    nxt = [r.label for r in stream.next_batch(4)]  # wraps into the next pass
    assert got == ["1", "2", "3", "4"] and nxt == ["5", "6", "1", "2"] and stream.epoch == 1
    again = PromptSource(_cfg(str(pq_dir), format="hf", streaming=True), tokenizer, 0)
    again.load_state_dict(state)
    assert [r.label for r in again.next_batch(4)] == nxt


def test_non_utf8_row_names_file_and_line_and_can_be_skipped(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n{"prompt": "c", "answer": "3"}\n')
    with pytest.raises(DataError, match=rf"{p}:2: not valid UTF-8 \(invalid continuation byte at byte 15 of the line\)"):
        PromptSource(_cfg(str(p), shuffle=False), tokenizer, 0).next_batch(3)
    src = PromptSource(_cfg(str(p), shuffle=False, skip_bad_rows=True), tokenizer, 0)
    assert [r.label for r in src.next_batch(2)] == ["1", "3"] and src.skipped == 1
    j = tmp_path / "d.json"
    j.write_bytes(b'[{"prompt": "caf\xe9", "answer": "2"}]')
    with pytest.raises(DataError, match=rf"{j}: not valid UTF-8 \(invalid continuation byte at byte 16\)"):
        PromptSource(_cfg(str(j)), tokenizer, 0)


def test_deeply_nested_row_is_a_bad_row_not_a_recursion_error(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"prompt": "a", "answer": "1"}, "[" * 100_000 + "]" * 100_000, {"prompt": "c", "answer": "3"}])
    with pytest.raises(DataError, match=rf"{p}:2: nested deeper than the JSON reader allows"):
        PromptSource(_cfg(str(p), shuffle=False), tokenizer, 0).next_batch(3)
    src = PromptSource(_cfg(str(p), shuffle=False, skip_bad_rows=True), tokenizer, 0)
    assert [r.label for r in src.next_batch(2)] == ["1", "3"] and src.skipped == 1
    j = tmp_path / "d.json"
    j.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match=rf"{j}: nested deeper than the JSON reader allows"):
        PromptSource(_cfg(str(j)), tokenizer, 0)


def test_jsonl_is_indexed_not_loaded_and_read_once_with_a_holdout(tmp_path, tokenizer, monkeypatch):
    """Issue 40: a 1M-row jsonl was read whole into dicts (~7x its size) and data.path twice with a
    holdout. Map-style jsonl is indexed (offsets, rows parsed on demand): the held-out split and
    the training source together stay well under the file's size in Python allocations
    (tracemalloc: about 40 bytes a row of index, prompt digests and order, against ~220 bytes a
    row of file; the old lists of dicts peaked at 6.5x the file), and the file is read through once."""
    import builtins
    import tracemalloc

    from megaforge.config import load_config
    from megaforge.build import RunBuilder

    def load_eval_sets(cfg, tokenizer):
        return RunBuilder(cfg).eval_sets(tokenizer)

    def cfg_for(path):
        return load_config(["--model.config", "configs/models/tiny-qwen2", "--model.tokenizer", "assets/tiny-tokenizer",
                            "--data.path", str(path), "--max_steps", "1", "--eval.interval", "1",
                            "--eval.sets", "[{name: held, holdout: 0.1, max_rows: 4}]"])

    def rows(n):
        return [{"prompt": f"Question {i}: what is {i} + {i * 7 % 13}?" + " pad" * 20, "answer": str(i),
                 "meta": {"source": "x" * 40, "tags": [1, 2, 3]}} for i in range(n)]

    warm = tmp_path / "warm.jsonl"  # imports and the chat template's compilation, outside the measurement
    _write_jsonl(warm, rows(20))
    PromptSource(cfg_for(warm).data, tokenizer, 0, exclude=load_eval_sets(cfg_for(warm), tokenizer)[1]).next_batch(2)
    big = tmp_path / "big.jsonl"
    _write_jsonl(big, rows(4000))
    cfg = cfg_for(big)
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    tracemalloc.start()
    try:
        sets, held = load_eval_sets(cfg, tokenizer)
        src = PromptSource(cfg.data, tokenizer, cfg.seed, exclude=held)
        batch = src.next_batch(8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = big.stat().st_size
    assert len(held) == 400 and len(src) == 3600 and src.held_out == 400 and len(batch) == 8
    assert peak < size / 2, f"peak {peak} bytes for a {size}-byte file"
    assert opened.count(str(big)) == 1, opened  # one pass: the index; rows are then read by offset
