"""tools/check_parity.py with its Hugging Face reference shifted by a known amount (a test driver).

    python parity_shifted.py SHIFT ARGS...   # ARGS: check_parity's

Every reference logprob gets ``+ SHIFT``, so the reported max |difference| is at least
``SHIFT - (the true parity error)``: with ``--tol`` below that, the run fails by construction,
whatever the rounding of the machine (the tool's failure path: report ``ok: false``, exit 1).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import check_parity  # noqa: E402


def main() -> int:
    shift = float(sys.argv[1])
    true_rows = check_parity.hf_rows

    def shifted_rows(*args, **kwargs):
        lp, am = true_rows(*args, **kwargs)
        return lp + shift, am

    check_parity.hf_rows = shifted_rows
    return check_parity.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
