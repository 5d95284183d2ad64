#!/usr/bin/env bash
# SGLang's default attention backend on Hopper (FA3) for the offline GPU machine (issue 38 point 4).
# The SGLang kit (../shared/gpu-wheels/sglang-prepare.sh) repacks sglang-kernel 0.4.5 without
# sgl_kernel/flash_ops.abi3.so (FA3: 1,122,607,032 bytes, 342 MB deflated in the wheel) to save carry,
# so every SGLang figure so far ran `--attention-backend triton`. This script takes that one file from
# the same pinned wheel, compresses it with xz -9 and cuts it into pieces of < 55 MB, so each device call
# carries one piece plus the tree under 64 MiB (tools/gpu/carry_size.py checks a call's size):
#   DIR/fa3-partK/flash_ops.abi3.so.xz.pNN   (K = 1..N, one piece each)
#   DIR/fa3-small/SHA256SUMS                 (of the .so and of the .xz)
# On the GPU machine, after SGLang's `parts` and `install` (its /tmp/site holds sgl_kernel):
#   one call per piece, carry DIR/fa3-partK:      bash tools/gpu/h200_session.sh fa3_part
#   then, carry DIR/fa3-small:                     bash tools/gpu/h200_session.sh fa3_install rollout_fa3
# (each call < 30 s after the last: /tmp lives only while the machine is held).
# usage: bash tools/gpu/fa3_prepare.sh DIR     (DIR must be git-ignored to be carried, e.g. .fa3 in
#        .git/info/exclude; needs pip with the package index and xz; ~12 min of one core for xz -9)
set -euo pipefail
dir=${1:?usage: fa3_prepare.sh DIR}
piece=${FA3_PIECE_BYTES:-55000000}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d "$tmp" sglang-kernel==0.4.5
whl=$(ls "$tmp"/sglang_kernel-0.4.5-*.whl)
unzip -q "$whl" sgl_kernel/flash_ops.abi3.so -d "$tmp/x"
so=$tmp/x/sgl_kernel/flash_ops.abi3.so
[ "$(stat -c %s "$so")" = 1122607032 ] || { echo "fa3_prepare: unexpected size of flash_ops.abi3.so in $whl"; exit 1; }
xz -9 -T0 -c "$so" > "$tmp/flash_ops.abi3.so.xz"
rm -rf "$dir"/fa3-small "$dir"/fa3-part*; mkdir -p "$dir/fa3-small"
(cd "$tmp/x/sgl_kernel" && sha256sum flash_ops.abi3.so) > "$dir/fa3-small/SHA256SUMS"
(cd "$tmp" && sha256sum flash_ops.abi3.so.xz) >> "$dir/fa3-small/SHA256SUMS"
(cd "$tmp" && split -b "$piece" -d -a 2 flash_ops.abi3.so.xz flash_ops.abi3.so.xz.p)
k=0
for p in "$tmp"/flash_ops.abi3.so.xz.p[0-9][0-9]; do
  k=$((k + 1)); mkdir -p "$dir/fa3-part$k"; mv "$p" "$dir/fa3-part$k/"
done
echo "$k pieces, $(stat -c %s "$tmp/flash_ops.abi3.so.xz") bytes of xz:"
ls -l "$dir"/fa3-part*/* "$dir/fa3-small"
