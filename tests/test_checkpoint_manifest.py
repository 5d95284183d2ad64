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
