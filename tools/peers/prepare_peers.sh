#!/usr/bin/env bash
# Here (network, no GPU): the peers' wheels for the offline H200 into DIR (default .carry/peers, ignored by git):
#   DIR/verl-ray/  ray 2.60.0 repacked (~45 MB)        DIR/verl-rest/  verl 0.9.1 and the rest of wheels_verl.txt
#   DIR/trl/       wheels_trl.txt                       DIR/SHA256SUMS  every file's checksum
# Python 3.12 x86-64 wheels without their dependencies (the lists name every one the machine lacks); the two
# sdists through ../shared/gpu-wheels/fetch-sdist.py. Sizes per call: python3 tools/gpu/carry_size.py DIR/verl-ray ...
# usage: bash tools/peers/prepare_peers.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.carry/peers}
shared=${SHARED:-}
for s in ../shared ../../shared /work/shared; do [ -z "$shared" ] && [ -d "$s/gpu-wheels" ] && shared=$s; done
[ -n "$shared" ] || { echo "megaforge: error: no shared/gpu-wheels folder (set SHARED)"; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
rm -rf "$dir"; mkdir -p "$dir/verl-ray" "$dir/verl-rest" "$dir/trl"
fetch() {  # $1: list file, $2: destination
  sed "s/#.*//; s/[[:space:]]*$//" "$1" | grep -v "^$" | while read -r req; do
    case $req in
      sdist:*) r=${req#sdist:}; python3 "$shared/gpu-wheels/fetch-sdist.py" "${r%%==*}" "${r##*==}" "$2" > /dev/null ;;
      *) python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
           -d "$2" "$req" ;;
    esac
  done
}
fetch tools/peers/wheels_verl.txt "$tmp/verl"
fetch tools/peers/wheels_trl.txt "$dir/trl"
for w in "$tmp"/verl/*; do
  case $(basename "$w") in
    ray-*.whl) python3 "$shared/gpu-wheels/wheel-repack.py" "$w" "$dir/verl-ray" 'ray/jars/*' 'ray/dashboard/client/build/*' ;;
    *) mv "$w" "$dir/verl-rest/" ;;
  esac
done
(cd "$dir" && sha256sum */* > SHA256SUMS)
du -sh "$dir"/*
