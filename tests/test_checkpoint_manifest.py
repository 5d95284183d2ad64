"""The checkpoint manifest: files over PIECE_BYTES are checksummed piece by piece (in parallel), small
ones whole; a flipped byte anywhere is found and named; manifests of whole-file digests (written
before the pieces) still verify."""
import hashlib
import json
import os

import pytest

from megaforge import checkpoint


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "PIECE_BYTES", 1000)  # pieces of 1,000 bytes: 2,500 bytes -> 3 pieces
    root = tmp_path / "step_000001"
    (root / "trainer").mkdir(parents=True)
    rng = __import__("random").Random(0)
    blobs = {"trainer/big.distcp": bytes(rng.getrandbits(8) for _ in range(2500)),
             "trainer/exact.distcp": bytes(rng.getrandbits(8) for _ in range(1000)),
             "state.json": b'{"rl_step": 1}', "empty.txt": b""}
    for rel, b in blobs.items():
        (root / rel).write_bytes(b)
    checkpoint.write_manifest(str(root))
    return root, blobs


def _manifest(root):
    return json.loads((root / "manifest.json").read_text())


def test_pieces_are_the_sha256_of_each_slice(ckpt):
    root, blobs = ckpt
    m = _manifest(root)
    big = blobs["trainer/big.distcp"]
    assert m["trainer/big.distcp"] == {"bytes": 2500, "piece_bytes": 1000, "sha256_pieces": [
        hashlib.sha256(big[i:i + 1000]).hexdigest() for i in (0, 1000, 2000)]}
    for rel in ("trainer/exact.distcp", "state.json", "empty.txt"):  # at most one piece: the whole file's digest
        assert m[rel] == {"sha256": hashlib.sha256(blobs[rel]).hexdigest(), "bytes": len(blobs[rel])}
    assert checkpoint.verify(str(root)) is None


@pytest.mark.parametrize("rel,at", [("trainer/big.distcp", 0), ("trainer/big.distcp", 1500),
                                    ("trainer/big.distcp", 2499), ("trainer/exact.distcp", 999)])
def test_a_flipped_byte_is_named(ckpt, rel, at):
    root, blobs = ckpt
    b = bytearray(blobs[rel])
    b[at] ^= 1
    (root / rel).write_bytes(bytes(b))
    assert checkpoint.verify(str(root)) == f"{rel}: checksum mismatch"


def test_whole_file_manifests_still_verify(ckpt):
    root, blobs = ckpt
    old = {rel: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for rel, b in blobs.items()}
    (root / "manifest.json").write_text(json.dumps(old))
    assert checkpoint.verify(str(root)) is None
    b = bytearray(blobs["trainer/big.distcp"])
    b[2100] ^= 0x80
    (root / "trainer/big.distcp").write_bytes(bytes(b))
    assert checkpoint.verify(str(root)) == "trainer/big.distcp: checksum mismatch"


def test_size_and_missing_files_are_named_before_hashing(ckpt):
    root, _ = ckpt
    with open(root / "trainer/big.distcp", "ab") as f:
        f.write(b"x")
    assert checkpoint.verify(str(root)) == "trainer/big.distcp: 2501 bytes, manifest says 2500"
    os.remove(root / "state.json")
    assert checkpoint.verify(str(root)) == "missing file state.json"


GOOD = {"bytes": 14, "sha256": "0" * 64}


@pytest.mark.parametrize("manifest,why", [
    ({}, "state.json is not listed (0 files are)"),
    ([], "expected a mapping of file -> size and sha256, got list"),
    ("x", "got str"),
    (None, "got NoneType"),
    ({"state.json": []}, "entry 'state.json': expected {'bytes': n >= 0, ...}, got []"),
    ({"state.json": {"bytes": "14", "sha256": "0" * 64}}, "entry 'state.json': expected {'bytes': n >= 0"),
    ({"state.json": {"bytes": True, "sha256": "0" * 64}}, "entry 'state.json': expected {'bytes': n >= 0"),
    ({"state.json": {"bytes": 14}}, "entry 'state.json': no sha256 (64 hex digits)"),
    ({"state.json": {"bytes": 14, "piece_bytes": 0, "sha256_pieces": ["0" * 64]}}, "one sha256 per piece"),
    ({"state.json": {"bytes": 14, "piece_bytes": 10, "sha256_pieces": ["0" * 64]}}, "one sha256 per piece"),
    ({"state.json": GOOD, "../outside": GOOD}, "entry '../outside' is not a relative path inside the checkpoint"),
    ({"state.json": GOOD, "/etc/passwd": GOOD}, "entry '/etc/passwd' is not a relative path"),
])
def test_a_manifest_not_of_the_written_form_makes_the_checkpoint_invalid(ckpt, manifest, why):
    root, _ = ckpt
    (root / "manifest.json").write_text(json.dumps(manifest))
    got = checkpoint.verify(str(root))
    assert got is not None and got.startswith("invalid manifest.json: ") and why in got, got


def test_a_non_utf8_manifest_is_unreadable(ckpt):
    root, _ = ckpt
    (root / "manifest.json").write_bytes(b'{"state.json": \xff}')
    assert checkpoint.verify(str(root)).startswith("unreadable manifest.json: ")


@pytest.mark.parametrize("manifest", [{}, []])
def test_resume_falls_back_past_an_invalid_manifest(ckpt, manifest):
    """``latest_valid`` (what --resume loads) names the checkpoint whose manifest is ``{}`` / ``[]`` and
    takes the previous complete one."""
    root, _ = ckpt
    newer = root.parent / "step_000002"
    import shutil
    shutil.copytree(root, newer)
    (newer / "manifest.json").write_text(json.dumps(manifest))
    said = []
    assert checkpoint.latest_valid(str(root.parent), log=said.append) == str(root)
    assert len(said) == 1 and "step_000002 is not usable (invalid manifest.json: " in said[0]
