#!/usr/bin/env python
"""What one device call moves, before making it: the working tree the `run` tool copies (tracked files
plus untracked files git does not ignore) plus the ignored paths named in ``carry``, against the
64 MiB limit of a call (/work/.library/device/README.md).

    python tools/gpu/carry_size.py .carry/q/SHA256SUMS .carry/q/Qwen2.5-Coder-0.5B-Instruct.gguf.part_09 .carry/data .carry/whl

Prints one JSON line (bytes of the tree and of each carried path, the total in MiB, ``fits``); exit 1
when it does not fit or a carried path is missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

LIMIT_MIB = 64


def tree_bytes(root: str = ".") -> int:
    """Bytes of the files the run tool copies: tracked, and untracked that git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    paths = {p for p in out.decode().split("\0") if p}
    return sum(os.path.getsize(os.path.join(root, p)) for p in paths if os.path.isfile(os.path.join(root, p)))


def path_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv: list[str]) -> int:
    missing = [p for p in argv if not os.path.exists(p)]
    carried = {p: path_bytes(p) for p in argv if p not in missing}
    tree = tree_bytes()
    total = tree + sum(carried.values())
    fits = total <= LIMIT_MIB * 2**20 and not missing
    print(json.dumps({"tree_bytes": tree, "carry_bytes": carried, "missing": missing,
                      "total_mib": round(total / 2**20, 2), "limit_mib": LIMIT_MIB, "fits": fits}))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
