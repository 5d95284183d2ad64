#!/usr/bin/env bash
# Here (network, no GPU): vLLM for TRL's colocate generation on the offline H100/H200 (tools/peers/wheels_vllm.txt),
# into DIR (default .carry/vllm, ignored by git):
#   DIR/vllm-partK/vllm-0.26.0-...whl.part_0N   the repacked vLLM wheel cut into equal parts of at most PART_BYTES
#                                                (50 MB: one part + the ~9.4 MB tree per device call, < 64 MiB)
#   DIR/vllm-deps/*.whl                          the other wheels of the list (not the [kit] ones: the SGLang kit's
#                                                /tmp/sgl has them on the machine)
#   DIR/SHA256SUMS                               the joined wheel, every part and every wheel
# The device calls (tools/peers/h200_peers.sh): one `vllm_part` a part, the last with vllm-deps and SHA256SUMS and
# then `vllm_kit` (join, check, install into /tmp/vllmsite, import check). It prints the calls and their sizes.
# usage: bash tools/peers/prepare_vllm.sh [DIR]        (~1 min with a warm pip cache; the vLLM wheel is 303.7 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.carry/vllm}
part=${PART_BYTES:-50000000}
shared=${SHARED:-}
for s in ../shared ../../shared /work/shared; do [ -z "$shared" ] && [ -d "$s/gpu-wheels" ] && shared=$s; done
[ -n "$shared" ] || { echo "megaforge: error: no shared/gpu-wheels folder (set SHARED)"; exit 2; }
list=tools/peers/wheels_vllm.txt
# the [kit] pins must be the SGLang kit's own versions (its list: shared/gpu-wheels/sglang.txt)
while read -r req; do
  [ -n "$req" ] || continue
  grep -qiE "^${req//./\\.}([[:space:]]|$)" "$shared/gpu-wheels/sglang.txt" \
    || { echo "megaforge: error: $req is marked [kit] but the SGLang kit ($shared/gpu-wheels/sglang.txt) pins another version"; exit 2; }
done < <(grep '\[kit\]' $list | sed 's/#.*//; s/[[:space:]]*$//')
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
rm -rf "$dir"; mkdir -p "$dir/vllm-deps"
grep -v '\[kit\]' $list | sed "s/#.*//; s/[[:space:]]*$//" | grep -v "^$" | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$tmp/dl" "$req"
done
# the three members below are what vLLM 0.26.0 loads only off this run's path (tools/peers/NEXT.md, A):
# FA2 (sm_90 takes FA3: vllm/v1/attention/backends/fa_utils.py), the MoE ops (imported under contextlib.suppress in
# vllm/platforms/cuda.py), the Rust frontend binary (only with VLLM_USE_RUST_FRONTEND)
for w in "$tmp"/dl/*.whl; do
  case $(basename "$w") in
    vllm-*.whl) python3 "$shared/gpu-wheels/wheel-repack.py" "$w" "$tmp/vllm" 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
                  'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/vllm-rs' ;;
    *) mv "$w" "$dir/vllm-deps/" ;;
  esac
done
whl=$(ls "$tmp"/vllm/vllm-*.whl); name=$(basename "$whl"); size=$(stat -c %s "$whl")
n=$(( (size + part - 1) / part ))
(cd "$tmp/vllm" && split -n "$n" -d -a 2 "$name" "$name.part_")
k=0
for p in "$tmp/vllm/$name".part_[0-9][0-9]; do
  k=$((k + 1)); mkdir -p "$dir/vllm-part$k"; mv "$p" "$dir/vllm-part$k/"
done
(cd "$tmp/vllm" && sha256sum "$name") > "$dir/SHA256SUMS"
(cd "$dir" && sha256sum vllm-part*/* vllm-deps/* >> SHA256SUMS)
echo "vllm wheel repacked: $size bytes in $k parts; deps: $(du -sb "$dir/vllm-deps" | cut -f1) bytes in $(ls "$dir/vllm-deps" | wc -l) wheels"
echo "device calls (after SGLang's parts and install; each carries the tree too):"
for i in $(seq 1 "$k"); do
  carry="$dir/vllm-part$i"; stages=vllm_part
  [ "$i" = "$k" ] && { carry="$carry $dir/vllm-deps $dir/SHA256SUMS"; stages="vllm_part vllm_kit"; }
  echo "  carry $carry: bash tools/peers/h200_peers.sh $stages"
  python3 tools/gpu/carry_size.py $carry
done
