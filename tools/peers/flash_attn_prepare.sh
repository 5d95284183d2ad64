#!/usr/bin/env bash
# Builds here (CPU only, PyPI only) a TRIMMED flash-attn 2.8.3 wheel for the offline H100/H200 machine
# (sm_90, Python 3.12, torch 2.11.0+cu130), for verl 0.9.1's `use_remove_padding=True` path: transformers'
# flash_attention_2 (flash_attn_varlen_func) and flash_attn.bert_padding, training Qwen2.5-Coder-0.5B
# (head dim 64, bfloat16).
#
# Why trimmed: the full FA2 build (72 kernel files x 4 architectures) takes hours on this 2-core machine. The wheel
# keeps only what that run calls: head dim 64 (head dims 33..64 run on it, as in the full build), bfloat16,
# forward + backward + split-KV forward, causal and non-causal (dropout, ALiBi, softcap, local windows stay built),
# the sm80 kernel sources compiled for `-gencode arch=compute_90,code=sm_90` only (SASS, no PTX). Any other head dim
# or float16 raises a RuntimeError naming the trimmed build (csrc/flash_attn/src/static_switch.h is patched), so
# nothing silently falls through. Version: 2.8.3+hdim64.bf16.sm90 (PEP 440 local version: transformers'
# `version.parse(...) >= "2.3.3"` still passes; verl 0.9.1 checks no flash-attn version).
#
# Toolchain, all from PyPI: torch==2.11.0 (PyPI's default build is +cu130), and CUDA 13.0 from NVIDIA's wheels:
# nvidia-cuda-nvcc (nvcc, ptxas, fatbinary, nvlink), nvidia-nvvm (cicc, libdevice), nvidia-cuda-crt (crt headers),
# nvidia-cuda-cccl (CUB/thrust/libcu++), nvidia-cuda-runtime (cudart); they all unpack into site-packages/nvidia/cu13,
# and CUDA_HOME is a folder of links to it laid out as nvcc and torch.utils.cpp_extension expect (bin/, include/,
# nvvm/, lib64/ with libcudart.so). nvidia-cuda-cuobjdump (13.2: no 13.0 on PyPI) only checks the SASS arch.
#
# Output in DIR (default .carry/fa2, ignored by git): the wheel (or, over 55,000,000 bytes, its parts
# <wheel>.part_00, _01, ...), SHA256SUMS (of the files in DIR, plus the joined wheel's in WHEEL.sha256 when split),
# BUILD.txt (versions, what was trimmed, build time, sizes).
#
# On the GPU machine (offline; it has torch 2.11.0+cu130 and transformers already):
#   w=flash_attn-2.8.3+hdim64.bf16.sm90-cp312-cp312-linux_x86_64.whl
#   cat DIR/$w.part_* > /tmp/$w   (or cp DIR/$w /tmp/ when not split); sha256sum /tmp/$w  (= DIR/WHEEL.sha256 / SHA256SUMS)
#   python3 -m pip install --no-index --no-deps --target /tmp/verlsite /tmp/$w
#   PYTHONPATH=/tmp/verlsite python3 tools/peers/fa2_check.py    # forward/backward vs SDPA; prints one JSON line
#
# usage: bash tools/peers/flash_attn_prepare.sh [DIR]
#   env: FA2_VENV (default /tmp/fa2-venv), FA2_WORK (default /tmp/fa2-build), FA2_REBUILD=1 (build again even if the
#        wheel is in FA2_WORK/dist), FA2_CLEAN=1 (also unpack and patch the sources afresh: no ninja reuse),
#        MAX_JOBS (default 2), NVCC_THREADS (default 1).
# Takes ~2 min for the toolchain (~3 GB of wheels) plus ~12.5 min of nvcc on 2 cores (BUILD.txt has the time).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.carry/fa2}
venv=${FA2_VENV:-/tmp/fa2-venv}
work=${FA2_WORK:-/tmp/fa2-build}
fa_version=$(sed -n "s/^flash-attn==\([0-9.]*\).*/\1/p" tools/peers/wheels_fa2.txt)  # the pin the tests check
[ "$fa_version" = 2.8.3 ] || { echo "flash_attn_prepare.sh patches 2.8.3 sources; tools/peers/wheels_fa2.txt pins $fa_version"; exit 2; }
local_tag=hdim64.bf16.sm90
full_version=$fa_version+$local_tag
max_part=55000000
export MAX_JOBS=${MAX_JOBS:-2} NVCC_THREADS=${NVCC_THREADS:-1}
log() { echo "fa2: $*"; }
die() { echo "fa2: error: $*" >&2; exit 1; }

shared=${SHARED:-}
for s in ../shared ../../shared /work/shared; do [ -z "$shared" ] && [ -d "$s/gpu-wheels" ] && shared=$s; done
[ -n "$shared" ] || die "no shared/gpu-wheels folder (set SHARED)"
mkdir -p "$work"

# ---- 1. Python 3.12 venv with torch 2.11.0+cu130 and the CUDA 13.0 compiler wheels --------------------------------
if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv (Python 3.12)"
  PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3.12 -m venv "$venv"
fi
py=$venv/bin/python
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || die "$venv is not Python 3.12"
pip_q() {  # quiet pip install; this machine's pip config names local index folders that may be absent: drop that noise
  local out; out=$("$py" -m pip install -q "$@" 2>&1) || { echo "$out" >&2; die "pip install $* failed"; }
  grep -v -e "is ignored: it is neither a file nor a directory" -e '^$' <<< "$out" || true
}
log "installing torch==2.11.0, the CUDA 13.0 compiler wheels and the build tools into $venv"
pip_q torch==2.11.0
pip_q "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*" \
  "nvidia-cuda-runtime==13.0.*" ninja packaging psutil wheel "setuptools<82" einops
[ -x "$work/cuobjdump/nvidia/cu13/bin/cuobjdump" ] ||
  pip_q --no-deps --target "$work/cuobjdump" "nvidia-cuda-cuobjdump==13.2.*"
torch_line=$("$py" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null)
[ "${torch_line#* }" = "13.0" ] || die "torch.version.cuda is not 13.0: $torch_line"
"$py" -m pip check >/dev/null 2>&1 || log "warning: pip check reports problems in $venv"

cu=$("$py" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
for f in bin/nvcc bin/ptxas bin/fatbinary bin/nvlink bin/cudafe++ nvvm/bin/cicc nvvm/libdevice/libdevice.10.bc \
         include/cuda_runtime.h include/cuda_bf16.h include/crt/host_defines.h include/cccl/cub/cub.cuh \
         include/cccl/thrust/version.h include/cublas_v2.h include/cusparse.h lib/libcudart.so.13; do
  [ -e "$cu/$f" ] || die "CUDA 13.0 wheels lack $f (looked in $cu)"
done
# CUDA_HOME: bin/ must be a real folder (nvcc takes its TOP as <dir of argv[0]>/..), the rest links.
cuda=$work/cuda
rm -rf "$cuda"; mkdir -p "$cuda/bin" "$cuda/lib64"
for f in "$cu"/bin/*; do ln -s "$f" "$cuda/bin/"; done
for f in "$cu"/lib/*; do ln -s "$f" "$cuda/lib64/"; done
ln -s libcudart.so.13 "$cuda/lib64/libcudart.so"
ln -s "$cu/include" "$cuda/include"; ln -s "$cu/nvvm" "$cuda/nvvm"
nvcc_line=$("$cuda/bin/nvcc" --version | grep release)
case $nvcc_line in *"release 13.0"*) ;; *) die "nvcc is not 13.0: $nvcc_line" ;; esac
log "torch $torch_line; nvcc: $nvcc_line"

# ---- 2. flash-attn 2.8.3 sdist (PyPI), unpacked ---------------------------------------------------------------------
sdist=$work/sdist/flash_attn-$fa_version.tar.gz
[ -s "$sdist" ] || python3 "$shared/gpu-wheels/fetch-sdist.py" flash-attn "$fa_version" "$work/sdist" 2>/dev/null >/dev/null
[ -s "$sdist" ] || die "no sdist at $sdist"
src=$work/src/flash_attn-$fa_version
if [ "${FA2_CLEAN:-0}" = 1 ] || [ ! -f "$src/.fa2-trimmed" ]; then
  rm -rf "$work/src"; mkdir -p "$work/src"
  tar xzf "$sdist" -C "$work/src"
fi
[ -f "$src/csrc/cutlass/include/cutlass/cutlass.h" ] && [ -d "$src/csrc/cutlass/include/cute" ] ||
  die "the sdist lacks csrc/cutlass"

# ---- 3. trim: sources, dispatch (static_switch.h), version ----------------------------------------------------------
kernels="flash_fwd_hdim64_bf16_sm80.cu flash_fwd_hdim64_bf16_causal_sm80.cu flash_bwd_hdim64_bf16_sm80.cu
flash_bwd_hdim64_bf16_causal_sm80.cu flash_fwd_split_hdim64_bf16_sm80.cu flash_fwd_split_hdim64_bf16_causal_sm80.cu"
if [ ! -f "$src/.fa2-trimmed" ]; then
  log "trimming $src"
  (cd "$src" && FA2_KERNELS="$kernels" FA2_VERSION="$full_version" "$py" - <<'EOF'
import os, re
kernels = os.environ["FA2_KERNELS"].split()
version = os.environ["FA2_VERSION"]

# setup.py: flash_attn_2_cuda gets flash_api.cpp + the six hdim64 bf16 kernel files
s = open("setup.py").read()
m = re.search(r'(name="flash_attn_2_cuda",\s*sources=\[)(.*?)(\n\s*\],)', s, re.S)
assert m, "setup.py: flash_attn_2_cuda sources not found"
listed = re.findall(r'"([^"]+)"', m.group(2))
keep = ["csrc/flash_attn/flash_api.cpp"] + ["csrc/flash_attn/src/" + k for k in kernels]
assert all(k in listed for k in keep) and len(listed) == 73, (len(listed), [k for k in keep if k not in listed])
for k in keep:
    assert os.path.exists(k), k
body = "".join(f'\n                "{k}",' for k in keep)
s = s[:m.start(2)] + body + s[m.end(2):]
open("setup.py", "w").write(s)

# static_switch.h: FP16_SWITCH -> bf16 only, HEADDIM_SWITCH -> 64 only; anything else is a TORCH_CHECK error
# (both macros are used only in flash_api.cpp, which has torch's headers)
p = "csrc/flash_attn/src/static_switch.h"
h = open(p).read()
i = h.index("#define FP16_SWITCH(COND, ...)")
assert "constexpr static int kHeadDim = 256;" in h[i:] and h[i:].count("#define") == 2
h = h[:i] + r'''// Trimmed build (flash-attn %(v)s): kernels for bfloat16 and head dim 64 only.
#define FLASH_TRIMMED_BUILD "flash-attn %(v)s is a trimmed build (head dim 64, bfloat16, sm_90 only): "

#define FP16_SWITCH(COND, ...)                                                        \
  [&] {                                                                               \
    if (COND) {                                                                       \
      TORCH_CHECK(false, FLASH_TRIMMED_BUILD "float16 kernels were not built; use bfloat16"); \
    } else {                                                                          \
      using elem_type = cutlass::bfloat16_t;                                          \
      return __VA_ARGS__();                                                           \
    }                                                                                 \
  }()

#define HEADDIM_SWITCH(HEADDIM, ...)                                                  \
  [&] {                                                                               \
    if (HEADDIM > 32 && HEADDIM <= 64) {                                              \
      constexpr static int kHeadDim = 64;                                             \
      return __VA_ARGS__();                                                           \
    } else {                                                                          \
      TORCH_CHECK(false, FLASH_TRIMMED_BUILD "only head dims 33..64 are supported, got head dim ", HEADDIM); \
    }                                                                                 \
  }()
''' % {"v": version}
open(p, "w").write(h)

# version: __init__.py (setup.py reads it; flash_attn.__version__ then names the build too)
p = "flash_attn/__init__.py"
t = open(p).read()
assert '__version__ = "2.8.3"\n' in t
open(p, "w").write(t.replace('__version__ = "2.8.3"\n', f'__version__ = "{version}"\n', 1))
print("trimmed:", ", ".join(keep))
EOF
  )
  touch "$src/.fa2-trimmed"
fi
grep -q "trimmed build" "$src/csrc/flash_attn/src/static_switch.h" || die "static_switch.h is not patched"

# ---- 4. build the wheel ---------------------------------------------------------------------------------------------
dist=$work/dist
whl_name=flash_attn-$full_version-cp312-cp312-linux_x86_64.whl
if [ "${FA2_REBUILD:-0}" = 1 ] || [ "${FA2_CLEAN:-0}" = 1 ] || [ ! -s "$dist/$whl_name" ]; then
  rm -rf "$dist"; mkdir -p "$dist"
  log "building (MAX_JOBS=$MAX_JOBS NVCC_THREADS=$NVCC_THREADS); log: $work/build.log"
  t0=$(date +%s)
  (cd "$src" && env CUDA_HOME="$cuda" PATH="$cuda/bin:$venv/bin:$PATH" FLASH_ATTENTION_FORCE_BUILD=TRUE \
     FLASH_ATTN_CUDA_ARCHS=90 TORCH_CUDA_ARCH_LIST=9.0 BUILD_TARGET=cuda \
     nice -n 10 "$py" setup.py bdist_wheel --dist-dir "$dist") > "$work/build.log" 2>&1 ||
    { tail -40 "$work/build.log"; die "build failed (log: $work/build.log)"; }
  t1=$(date +%s)
  echo $((t1 - t0)) > "$work/build_seconds"
fi
[ -s "$dist/$whl_name" ] || die "no $whl_name in $dist: $(ls "$dist")"
whl=$dist/$whl_name
build_s=$(cat "$work/build_seconds" 2>/dev/null || echo "?")
log "wheel $whl_name, $(stat -c %s "$whl") bytes, built in ${build_s} s"

# ---- checks: contents, linkage, SASS arch, import -------------------------------------------------------------------
chk=$work/check; rm -rf "$chk"; mkdir -p "$chk/site"
"$py" -m pip install -q --no-index --no-deps --target "$chk/site" "$whl"
so=$(ls "$chk/site"/flash_attn_2_cuda*.so)
needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort | tr '\n' ' ')
for n in $needed; do
  case $n in
    libc10.so|libc10_cuda.so|libtorch.so|libtorch_cpu.so|libtorch_cuda.so|libtorch_python.so|libcudart.so.13) ;;
    libstdc++.so.6|libgcc_s.so.1|libc.so.6|libm.so.6|ld-linux-x86-64.so.2) ;;
    *) die "flash_attn_2_cuda links $n (not torch/cudart/system)" ;;
  esac
done
torch_lib=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
ldd_out=$(LD_LIBRARY_PATH="$torch_lib:$cu/lib" ldd "$so")
! grep -q "not found" <<< "$ldd_out" || die "ldd: $ldd_out"
sass=$("$work/cuobjdump/nvidia/cu13/bin/cuobjdump" --list-elf "$so" | sed 's/.*\.\(sm_[0-9a-z]*\)\.cubin/\1/' | sort | uniq -c | awk '{printf "%s x %s;", $1, $2}')
ptx=$("$work/cuobjdump/nvidia/cu13/bin/cuobjdump" --list-ptx "$so" 2>&1 | grep -c "^PTX file" || true)
case $sass in *sm_90*) ;; *) die "no sm_90 SASS in $so: $sass" ;; esac
grep -q "sm_" <<< "${sass//sm_90/}" && die "SASS other than sm_90: $sass"
import_out=$(cd /tmp && PYTHONPATH="$chk/site" "$py" -W ignore -c '
import importlib.metadata as md
import flash_attn, flash_attn_2_cuda
from flash_attn import flash_attn_varlen_func, flash_attn_func
from flash_attn.bert_padding import unpad_input, pad_input, index_first_axis
from packaging.version import Version
v = md.version("flash_attn")
assert Version(v) >= Version("2.3.3") and flash_attn.__version__ == v, (v, flash_attn.__version__)
print("flash_attn", flash_attn.__version__, "metadata", v, "from", flash_attn.__file__)' 2>&1) ||
  die "import check failed: $import_out"
log "import: $import_out"
log "NEEDED: $needed"
log "SASS: $sass PTX files: $ptx"

# ---- 5. the kit -----------------------------------------------------------------------------------------------------
rm -rf "$dir"; mkdir -p "$dir"
whl_sha=$(sha256sum "$whl" | cut -c1-64)
whl_size=$(stat -c %s "$whl")
if [ "$whl_size" -gt "$max_part" ]; then
  split -b "$max_part" -d -a 2 "$whl" "$dir/$whl_name.part_"
  echo "$whl_sha  $whl_name" > "$dir/WHEEL.sha256"
  parts="split into $(ls "$dir" | grep -c '\.part_') parts of <= $max_part bytes: join with cat $whl_name.part_* > $whl_name"
else
  cp "$whl" "$dir/"
  parts="not split (<= $max_part bytes)"
fi
so_size=$(stat -c %s "$so")
{
  echo "flash-attn $full_version: a TRIMMED build for verl 0.9.1 use_remove_padding on H100/H200 (sm_90)"
  echo "made by tools/peers/flash_attn_prepare.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) CPU cores, no GPU"
  echo
  echo "wheel: $whl_name"
  echo "  size $whl_size bytes, sha256 $whl_sha; $parts"
  echo "  flash_attn_2_cuda .so: $so_size bytes; NEEDED: $needed"
  echo "  cuobjdump: SASS cubins $sass PTX entries $ptx"
  echo "  import check (CPU): $import_out"
  echo
  echo "versions:"
  echo "  python $("$py" -c 'import sys; print(sys.version.split()[0])')"
  echo "  torch $torch_line (torch==2.11.0 from PyPI; its Linux wheel is the +cu130 build)"
  echo "  nvcc $nvcc_line (wheels: $("$py" -m pip list 2>/dev/null | grep -E '^nvidia-(cuda-nvcc|nvvm|cuda-crt|cuda-cccl|cuda-runtime) ' | tr -s ' ' | tr '\n' ';'))"
  echo "  gcc $(gcc -dumpfullversion); setuptools $("$py" -c 'import setuptools; print(setuptools.__version__)'); ninja $("$venv/bin/ninja" --version)"
  echo "  flash-attn sdist $(basename "$sdist") sha256 $(sha256sum "$sdist" | cut -c1-64)"
  echo
  echo "trimmed (the full build: 72 kernel files for fp16+bf16, head dims 32..256, gencode 80;90;100;120):"
  echo "  sources: csrc/flash_attn/flash_api.cpp + $(echo $kernels | tr ' ' ',')"
  echo "  csrc/flash_attn/src/static_switch.h: HEADDIM_SWITCH only kHeadDim=64 (head dims 33..64), FP16_SWITCH only"
  echo "    bfloat16; other head dims and float16 raise RuntimeError 'flash-attn $full_version is a trimmed build ...'"
  echo "  kept: forward, backward, split-KV forward (flash_attn_with_kvcache / num_splits), causal and non-causal,"
  echo "    dropout, ALiBi, softcap, local (sliding) windows, varlen and padded batches"
  echo "  gencode: -gencode arch=compute_90,code=sm_90 only (FLASH_ATTN_CUDA_ARCHS=90): sm_90 SASS, no PTX, so it"
  echo "    runs on H100/H200 only"
  echo "  env: FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS=$MAX_JOBS NVCC_THREADS=$NVCC_THREADS; version $full_version"
  echo "    (flash_attn/__init__.py patched; PEP 440 local version, >= 2.3.3 for transformers' check)"
  echo
  echo "build time: ${build_s} s (python setup.py bdist_wheel, MAX_JOBS=$MAX_JOBS, NVCC_THREADS=$NVCC_THREADS)"
  echo
  echo "install on the GPU machine: join the parts if split (cat $whl_name.part_* > /tmp/$whl_name), check sha256, then"
  echo "  python3 -m pip install --no-index --no-deps --target /tmp/verlsite /tmp/$whl_name"
  echo "  PYTHONPATH=/tmp/verlsite python3 tools/peers/fa2_check.py"
} > "$dir/BUILD.txt"
(cd "$dir" && sha256sum $(ls | grep -v '^SHA256SUMS$') > SHA256SUMS)
ls -l "$dir"
log "done: $(du -sh "$dir" | cut -f1) in $dir"
