"""The example's task: one-digit sums and differences ``a + b`` / ``a - b`` (a, b in 0..9: all 200, the
differences negative when b > a), each asked in a chat that starts with one worked example turn and
answered in ``\\boxed{}`` (the math reward checks it).

    python examples/real_model_cpu/make_data.py OUT.jsonl

Rows: ``{"prompt": [user, assistant, user], "answer": "a+b"}`` (megaforge's data loader puts the chat
list through the model's chat template)."""
from __future__ import annotations

import json
import os
import sys

EXAMPLE = [{"role": "user", "content": "What is 3 + 4? Put the final answer in \\boxed{}."},
           {"role": "assistant", "content": "3 + 4 = 7. The answer is \\boxed{7}."}]


def rows() -> list[dict]:
    return [{"prompt": EXAMPLE + [{"role": "user", "content": f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."}],
             "answer": str(a + b if op == "+" else a - b)} for op in "+-" for a in range(10) for b in range(10)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(argv[0])), exist_ok=True)
    with open(argv[0], "w") as f:
        for r in rows():
            f.write(json.dumps(r) + "\n")
    print(f"{argv[0]}: {len(rows())} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
