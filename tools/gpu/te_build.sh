#!/usr/bin/env bash
# Transformer Engine on the offline GPU machine, into its own folder (not SGLang's /tmp/site: that one
# holds SGLang's transformers pin, which the trainer must not import). Input: a kit made here with
#   bash ../shared/gpu-wheels/te-prepare.sh .tep        (te-small/ and the core wheel in te-part1..6/)
# and, on the machine, the six parts joined in order into /tmp/te/core.part
# (tools/gpu/h200_session.sh te1 .. te6). Then:
#   bash tools/gpu/te_build.sh .tep/te-small /tmp/tesite     # then PYTHONPATH=...:/tmp/tesite
# TE_EXT_OUT=DIR also writes the built torch extension there in 15 MB pieces (te_ext.tgz.00, ...); a later
# session carries them (e.g. .tep/te-ext) and skips the 3-6 minute build: TE_EXT_DIR=.tep/te-ext bash tools/gpu/te_build.sh ...
set -euo pipefail
kit=$(cd "${1:?usage: te_build.sh KIT_DIR TARGET}" && pwd); target=${2:?usage: te_build.sh KIT_DIR TARGET}
mkdir -p /tmp/te "$target"
core=/tmp/te/$(cat "$kit/core.name")
[ -f /tmp/te/core.part ] && mv -f /tmp/te/core.part "$core"
[ "$(sha256sum "$core" | cut -c1-64)" = "$(cat "$kit/core.sha256")" ] || { echo "te_build: $core: checksum mismatch (parts missing or out of order?)"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target "$target" "$core" "$kit"/*.whl
rm -rf /tmp/te/src /tmp/te/ext && mkdir -p /tmp/te/src /tmp/te/ext
if [ -n "${TE_EXT_DIR:-}" ]; then  # the torch extension built by an earlier call (its te_ext.tgz.* pieces)
  cat "$TE_EXT_DIR"/te_ext.tgz.* | tar xzf - -C /tmp/te/ext
else
  tar xzf "$kit"/transformer_engine_torch-*.tar.gz -C /tmp/te/src
  (cd /tmp/te/src/transformer_engine_torch-* && NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} \
    MAX_JOBS=${MAX_JOBS:-$(nproc)} NVTE_FRAMEWORK=pytorch \
    PYTHONPATH=$target python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/te/ext .)
  # the build, for later calls (TE_EXT_DIR): pieces of 15 MB (a device call returns files of at most 16 MiB)
  if [ -n "${TE_EXT_OUT:-}" ]; then
    mkdir -p "$TE_EXT_OUT" && tar czf - -C /tmp/te/ext . | split -b 15000000 -d - "$TE_EXT_OUT/te_ext.tgz."
  fi
fi
cp -rn /tmp/te/ext/* "$target"/
PYTHONPATH=$target python3 -c "import transformer_engine.pytorch as te; print('transformer_engine', te.__file__)"
