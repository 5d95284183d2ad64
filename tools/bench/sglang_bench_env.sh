#!/usr/bin/env bash
# A CPU virtualenv with SGLang 0.5.16's bench_serving, to run it against megaforge's embedded server
# (issue 41 point 1: tests/rollout/server/test_openai_api.py::test_sglang_bench_serving_openai_modes,
# which is skipped where sglang is not importable). sglang is installed without its dependencies (its pins
# want CUDA torch 2.11); the modules `import sglang` and bench_serving reach are added by name, and
# transformers is held at 5.12.1 (sglang 0.5.16's pin: with 5.17 its config registry clashes at import).
# megaforge and the rest come from the system site (--system-site-packages).
#   bash tools/bench/sglang_bench_env.sh /tmp/sglvenv
#   /tmp/sglvenv/bin/python -m pytest -q tests/rollout/server/test_openai_api.py -k bench_serving
set -euo pipefail
VENV=${1:-/tmp/sglvenv}
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps sglang==0.5.16
# torchvision (sglang.srt.utils imports it) with the torch it was built against, into the venv: PyPI's torchvision
# does not load its operators on the CPU build of torch this machine installs from local disk
# ("operator torchvision::nms does not exist"). That torch is PyPI's (CUDA) build: a download of a few GB.
"$VENV/bin/pip" install -q torchvision
"$VENV/bin/pip" install -q pybase64 triton starlette pyzmq transformers==5.12.1 msgspec \
    partial_json_parser xgrammar sentencepiece einops compressed_tensors datasets aiohttp
"$VENV/bin/python" -m sglang.bench_serving --help > /dev/null && echo "sglang.bench_serving ready in $VENV"
