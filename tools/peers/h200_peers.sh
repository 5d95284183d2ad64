#!/usr/bin/env bash
# The side-by-side runs of issue 39 on the offline H200, in the device calls a session makes (each < 10 min, chained
# within the 30 s the machine stays warm so /tmp survives; the runs start detached, in their own process session,
# and keep going across calls while the machine is held: tools/gpu/h200_session.sh's gsm_start way). Results go to $OUT.
# Hold 1 ran 2026-12-06 on an H200 (code fd52435; docs/benchmarks/peers_h200_hold1_*): device start 28 s, parts 0.3 s,
#   install 25 s, kit 15 s, gsm_part 0.2-0.5 s each (~4 s held), gsm_prep 54 s convert, data 47 s (3 verl config
#   checks), megaforge 8 steps (108 s start-up, ~6.5 s a step, its end-of-run evaluation ~35 s), verl mapped: 152 s
#   start-up, 91 s first step, ~58 s a step (10 of 20 steps in the hold: killed after step 10's checkpoint),
#   evaluate.py ~70 s each (SGLang's start included). verl's first launch failed: data had written the overrides
#   under $OUT, which is emptied for every call (now kept under /tmp/peers). TRL and verl best/defaults: not run yet.
#
# Here, once: bash tools/peers/prepare_peers.sh        (.carry/peers: 50.8 MB of wheels; ignored by git)
#             plus the SGLang kit (.sgl) and the GSM8K model / data / wheels (.carry/q, .carry/data, .carry/whl) as
#             configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml's header says.
# One hold (~30 min), the calls one right after the other (sizes: python3 tools/gpu/carry_size.py PATHS):
#   1  carry .sgl/sgl-part1 .sgl/sgl-part2:   bash tools/gpu/h200_session.sh parts            (alone: a refused start costs)
#   2  carry .sgl/sgl-small .whl:             bash tools/gpu/h200_session.sh install
#   3  carry .carry/peers/verl-ray .carry/peers/verl-rest .carry/peers/trl .carry/peers/SHA256SUMS (56.3 MiB):
#                                             bash tools/peers/h200_peers.sh kit
#   4..13 carry .carry/q/SHA256SUMS + one .carry/q/*.part_0K (K = 0..9):  bash tools/gpu/h200_session.sh gsm_part
#   14 carry .carry/data .carry/whl (with the last part it was over 64 MiB once the tree reached ~11 MB):
#        bash tools/gpu/h200_session.sh gsm_prep && PEER_STEPS=20 bash tools/peers/h200_peers.sh data mf_start \
#          && sleep 200 && bash tools/peers/h200_peers.sh mf_watch
#   15 bash tools/peers/h200_peers.sh mf_watch verl_start && sleep 240 && WATCH_SECONDS=200 bash tools/peers/h200_peers.sh verl_watch
#   16.. WATCH_SECONDS=540 bash tools/peers/h200_peers.sh verl_watch     (until "run ended"), then
#   last: bash tools/peers/h200_peers.sh eval_verl compare
# TRL in its own hold (same calls 1-14 without SGLang's two if megaforge's steps are not rerun... they are: every hold
# that runs a peer also runs megaforge for a few steps), then trl_start / trl_watch / eval_trl / compare.
# Hold 2 ran 2026-12-07 on an H100 80GB (code 0c854e7 + 9fca4a7's harness; no H200 lent, two refused starts ~180 s):
#   parts 0.2 s; install 26 s + PEER_KITS=trl kit 4 s (one call); gsm_part 0.2-0.5 s each (~4 s held); gsm_prep 66 s
#   convert; data 12 s; megaforge 50 steps: 125 s start-up, 6.22 s a step, HF export every 10, evaluated after step 50
#   (~7.5 min in all; its first launch was lost to a flag the config refuses, ~160 s: fixed, and checked on the CPU by
#   tests/tools/test_peers.py); TRL 10 steps: 13 s start-up, 63.8 s first step, ~38.8 s a step (~7 min); eval_trl of 5
#   models (greedy only) 105 s; 1,692 of 1,800 device s used. Only 8 files come back a call: end with `compare bundle`.
# Variables: PEER_STEPS (20), MF_STEPS (5), MF_EXPORT_EVERY (MF_STEPS), MF_EVAL_STEPS (the megaforge steps graded: MF_STEPS), MF_FLAGS (more launcher flags for megaforge, e.g. "--memory.offload auto"), VERL_VARIANT (mapped | best | defaults), VERL_VARIANTS (the variants `data`
#            writes and checks: VERL_VARIANT by default, "" for none), HOLD (hold1), TRL_VLLM (0), TRL_VARIANT (mapped | defaults),
#            MEGAFORGE_COMMIT (provenance of the JSON lines), VLLM_KIT (/tmp/vllmkit), VLLM_SITE (/tmp/vllmsite),
#            SGL_WHEELS (/tmp/sgl: the SGLang kit's wheels vllm_kit takes), TRL_SITE (/tmp/trlsite, for vllm_check).
# Budget of a hold, from hold 1's figures: setup to megaforge's launch ~250 s (device start, parts, install, kit, 9 GGUF
#   calls, convert, data); megaforge MF_STEPS=5 ~150 s (108 s start-up, ~6.5 s a step; hold 1 also evaluated in the
#   run, ~35 s: now its last step's HF export is graded with the peer's models instead); evaluate.py ~70 s a model alone (SGLang's start ~35 s of it; the stages now grade all of a hold's models
#   in one call: one start, then each next model's weights sent to the running engine). Left for the peer: ~1,200 s of the 1,800. verl mapped (152 s start-up, 91 s
#   first step, ~58 s a step) fits ~17 steps and no evaluation: run PEER_STEPS=20 for the data, stop after step 10's
#   checkpoint, or make verl's 20 steps the hold's only peer work with megaforge at MF_STEPS=3.
# Next holds: hold 2 TRL (HOLD=hold2 PEER_STEPS=10 VERL_VARIANTS=""): calls 1-11 as above, then
#   gsm_prep && data mf_start && sleep 170 && mf_watch; then trl_start, trl_watch until it ends; EVAL_BASE=0 eval_trl
#   (its checkpoint-40 = step 10; the base model is graded already: 0.26687, hold 1). Hold 3: verl defaults (VERL_VARIANT=
#   defaults HOLD=hold3). verl best needs flash-attn 2.8.3 for torch 2.11 + CUDA 13 (verl's flash-attn-cu130torch211
#   extra; PyPI has only its sdist, whose setup downloads a wheel from GitHub, unreachable): built here, trimmed to head
#   dim 64 / bf16 / sm_90, by tools/peers/flash_attn_prepare.sh into .carry/fa2 (8.9 MB). Its hold (HOLD=hold4
#   VERL_VARIANT=best): call 1 carries .sgl/sgl-part1 .sgl/sgl-part2 .carry/fa2 (63.6 MiB): parts && cp -r .carry/fa2
#   /tmp/fa2kit; after kit: FA2_KIT=/tmp/fa2kit fa2_kit (install + tools/peers/fa2_check.py); then as hold 1.
# TRL with vLLM 0.26.0 colocate (TRL_VLLM=1): tools/peers/prepare_vllm.sh, then three vllm_part calls, the last with
#   vllm_kit, after parts + install + PEER_KITS=trl kit; the whole hold's calls are in tools/peers/NEXT.md (A).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
P=${PEERS_DIR:-/tmp/peers}; mkdir -p $P
RECIPE=${RECIPE:-configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml}
MODEL=/tmp/qwen2.5-coder-0.5b-instruct
EVAL_DATA=${EVAL_DATA:-/tmp/mf/data/gsm8k/test.jsonl}
HOLD=${HOLD:-hold1}
MF=${MF_STEPS:-5}
MF_EVERY=${MF_EXPORT_EVERY:-$MF}  # megaforge's run exports HF weights every MF_EVERY steps (outside the step times)
MF_GRADE=${MF_EVAL_STEPS:-$MF}  # ... and the eval stages grade these steps' exports with the peer's models
mf_flags() {  # megaforge's launcher flags in a hold (mf_start; tests/tools/test_peers_h200.py checks them with --dry_run)
  echo --config $RECIPE --run_name peers_mf --max_steps "$MF" --eval.before_train false --eval.interval "$MF" \
    --export_hf_every "$MF_EVERY" --checkpoint.interval 0 --metrics.progress false
}
mf_specs() {  # evaluate's arguments for megaforge's graded exports, newest first
  local s; for s in $(printf '%s\n' $MF_GRADE | sort -rn); do echo "megaforge $s /tmp/runs/peers_mf/hf/step_$s megaforge:$HOLD"; done
}
STEPS=${PEER_STEPS:-20}
V=${VERL_VARIANT:-mapped}
TRL_RUN=$HOLD-trl; [ "${TRL_VLLM:-0}" = 1 ] && TRL_RUN=$HOLD-trl-vllm  # the run label of TRL's schema lines and grades
[ "${TRL_VARIANT:-mapped}" = mapped ] || TRL_RUN=$TRL_RUN-${TRL_VARIANT}  # TRL_VARIANT=defaults: TRL's own checkpointing and micro-batch
VK=${VLLM_KIT:-/tmp/vllmkit}  # vllm_part collects the carried vLLM kit here; vllm_kit writes its env.sh here
VS=${VLLM_SITE:-/tmp/vllmsite}  # ... and installs it here (SGL_WHEELS: the SGLang kit's wheels, /tmp/sgl)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MF_PATH=$PWD:/tmp/mfsite
engine_env() {  # ENGINE_ENV_JSON: given instead (tests on a CPU, without the kit)
  [ -n "${ENGINE_ENV_JSON:-}" ] && { echo "$ENGINE_ENV_JSON"; return; }
  PYTHONPATH=$MF_PATH python3 -c "import json; from megaforge.supervise import env_from_script; print(json.dumps(env_from_script('/tmp/sgl/env.sh')))"
}
launch() {  # $1: name, $2: log file that grows one line per step, then the command: detached, stamped, launch time kept
  local name=$1 log=$2; shift 2
  date +%s.%N > $P/$name.launch_t
  setsid "$@" >> $P/$name.out 2>&1 < /dev/null &
  echo $! > $P/$name.pid
  setsid python3 tools/peers/stamp.py "$log" $P/$name.stamps --pid "$(cat $P/$name.pid)" < /dev/null > /dev/null 2>&1 &
  sleep 5; echo "[h200_peers] $name started: pid $(cat $P/$name.pid)"; tail -3 $P/$name.out
}
watch_run() {  # $1: name, $2: its metrics file: follow for WATCH_SECONDS or until it exits
  local pid; pid=$(cat $P/$1.pid); local t0=$SECONDS seen=0 n
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${WATCH_SECONDS:-540}" ]; do
    sleep 10; n=$(wc -l < "$2" 2>/dev/null || echo 0)
    [ "$n" -gt "$seen" ] && { tail -n $((n - seen)) "$2" | cut -c1-300; seen=$n; }
  done
  kill -0 "$pid" 2>/dev/null && echo "[h200_peers] $1 still going at $(date +%T)" || echo "[h200_peers] $1 ended"
  tail -c 8000000 $P/$1.out > "$OUT/$1.log"
  grep -v -i warn $P/$1.out | grep -i "error\|Traceback" | tail -5
}
evaluate() {  # arguments "name step hf_folder system:run[,system:run]", newest first: all through one tools/evaluate.py
  # call (one SGLang start; each next model's weights sent to the running engine); a model without its line then alone
  # -> $OUT/eval_<name>_<step>.jsonl and its per-prompt file eval_<name>_<step>_samples.jsonl.gz (compare.py --mcnemar)
  local args=() kept=() spec name step hf pairs i log
  for spec in "$@"; do
    read -r name step hf pairs <<< "$spec"
    if [ -f "$hf/config.json" ]; then args+=(--model "$hf"); kept+=("$spec"); else echo "[h200_peers] no HF folder at $hf"; fi
  done
  [ ${#kept[@]} -gt 0 ] || return 1
  log=$P/eval_$(date +%s).log
  run_eval() {  # $1: per-sample file (template), then --model ... ; appends to $log
    local out=$1; shift
    PYTHONPATH=$MF_PATH timeout -k 20 $((240 + 45 * $#)) python3 tools/evaluate.py "$@" --config $RECIPE \
      --data "$EVAL_DATA" --rollout.engine_env "$(engine_env)" ${EVAL_FLAGS:-} --out "$out" >> $log 2>&1; echo "exit $?"
  }
  run_eval "$P/eval_{model}_samples.jsonl" "${args[@]}"
  i=0
  for spec in "${kept[@]}"; do
    read -r name step hf pairs <<< "$spec"
    if ! grep -q "\"model\": \"$hf\"" $log; then  # evaluate.py prints the folder's absolute path (all here are)
      echo "[h200_peers] $hf: not in the shared call's output; evaluated alone"
      run_eval "$P/eval_${i}_samples.jsonl" --model "$hf"
    fi
    gzip -c $P/eval_${i}_samples.jsonl > "$OUT/eval_${name}_${step}_samples.jsonl.gz" 2>/dev/null
    : > "$OUT/eval_${name}_${step}.jsonl"
    for sr in ${pairs//,/ }; do
      python3 tools/peers/parse_logs.py evaluate $log --model "$hf" --for "${sr%%:*}" --step "$step" --run "${sr#*:}" \
        --out - >> "$OUT/eval_${name}_${step}.jsonl"
    done
    cat "$OUT/eval_${name}_${step}.jsonl"; i=$((i + 1))
  done
  cp $log "$OUT/"
}
vllm_kit() {  # the vllm_kit stage's install: join + check the parts, pip --no-deps into $VS, write $VK/env.sh
  local sums=$VK/SHA256SUMS w n have req f kit=() t0=$SECONDS
  [ -f "$sums" ] || { echo "[h200_peers] vllm_kit: no $sums (carried with the last part)"; return 1; }
  n=$(grep -c '\.part_[0-9]*$' "$sums"); have=$(ls "$VK"/vllm-part*/*.part_[0-9][0-9] 2>/dev/null | wc -l)
  [ "$n" = "$have" ] || { echo "[h200_peers] vllm_kit: $have of $n parts under $VK (one vllm_part call a part)"; return 1; }
  (cd "$VK" && sha256sum --quiet -c --ignore-missing SHA256SUMS) || return 1
  w=$(head -1 "$sums" | awk '{print $2}')  # the joined wheel's name (prepare_vllm.sh writes it first)
  for f in "$VK"/vllm-part*/*.part_[0-9][0-9]; do echo "$(basename "$f") $f"; done | sort | cut -d' ' -f2 | xargs cat > "$VK/$w"
  (cd "$VK" && head -1 SHA256SUMS | sha256sum --quiet -c) || return 1
  while read -r req; do  # name==version of each [kit] line; the kit's file names use _ for - and lower case
    f=$(ls "${SGL_WHEELS:-/tmp/sgl}/${req%%==*}-${req##*==}-"*.whl 2>/dev/null | head -1)
    [ -n "$f" ] || { echo "[h200_peers] vllm_kit: $req not in ${SGL_WHEELS:-/tmp/sgl} (SGLang's parts + install first)"; return 1; }
    kit+=("$f")
  done < <(grep '\[kit\]' tools/peers/wheels_vllm.txt | sed 's/#.*//; s/[[:space:]]*$//' | grep -v '^$' \
           | awk -F'==' '{gsub(/-/, "_", $1); print tolower($1) "==" $2}')
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$VS" "$VK/$w" "$VK"/vllm-deps/*.whl \
    "${kit[@]}" > "$VK/pip.log" 2>&1 || { tail -20 "$VK/pip.log"; return 1; }
  rm -f "$VK/$w"
  echo "[h200_peers] vllm_kit: $w + $(ls "$VK"/vllm-deps | wc -l) wheels + ${#kit[@]} of the SGLang kit's into $VS in $((SECONDS - t0)) s"
  local nvlibs  # vLLM's ops need libcudart / libnvrtc .so.13 (torch's own nvidia/*/lib), as sglang-install.sh's env.sh
  nvlibs=$(python3 -c 'import os, nvidia
print(":".join(sorted({os.path.join(r, d, "lib") for r in nvidia.__path__ for d in os.listdir(r)
                       if os.path.isdir(os.path.join(r, d, "lib"))})))' 2>/dev/null || true)
  { echo "export LD_LIBRARY_PATH=${nvlibs}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"; } > "$VK/env.sh"
}

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    kit)  # the peers' wheels: verl's into /tmp/verlsite, TRL's into /tmp/trlsite (checked against SHA256SUMS first);
      # PEER_KITS="trl" (or "verl"): that peer's alone, so a TRL hold carries only .carry/peers/trl + SHA256SUMS
      kits=${PEER_KITS:-verl trl}
      (cd .carry/peers && sha256sum --quiet -c --ignore-missing SHA256SUMS) || exit 1
      for k in $kits; do [ -d .carry/peers/$k ] || [ -d .carry/peers/$k-rest ] || { echo "[h200_peers] kit $k: not carried"; exit 1; }; done
      : > $P/kit.log
      if [[ " $kits " == *" verl "* ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/verlsite \
          .carry/peers/verl-ray/*.whl .carry/peers/verl-rest/*.whl .carry/peers/verl-rest/*.tar.gz >> $P/kit.log 2>&1 \
          || { tail -20 $P/kit.log; exit 1; }
        (. /tmp/sgl/env.sh && PYTHONPATH=/tmp/verlsite:$PWD:$PYTHONPATH python3 -c "import verl, ray, transfer_queue, hydra; print('verl', verl.__version__, 'ray', ray.__version__)")
      fi
      if [[ " $kits " == *" trl "* ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/trlsite .carry/peers/trl/*.whl \
          >> $P/kit.log 2>&1 || { tail -20 $P/kit.log; exit 1; }
        PYTHONPATH=$PWD:/tmp/trlsite python3 -c "import trl, transformers; print('trl', trl.__version__, 'transformers', transformers.__version__)"
      fi ;;
    fa2_kit)  # flash-attn 2.8.3, trimmed (tools/peers/flash_attn_prepare.sh: head dim 64, bf16, sm_90) into verl's site,
      # then its GPU check against torch's attention (tools/peers/fa2_check.py); carry .carry/fa2 (after kit)
      k=${FA2_KIT:-.carry/fa2}  # FA2_KIT=/tmp/fa2kit when an earlier call copied it there
      (cd $k && sha256sum --quiet -c SHA256SUMS) || exit 1
      w=$(ls $k/*.whl 2>/dev/null | head -1)
      if [ -z "$w" ]; then  # parts: joined under /tmp
        first=$(ls $k/*.part_00 | head -1); w=/tmp/$(basename "${first%.part_00}")
        cat "${first%.part_00}".part_* > "$w"
      fi
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/verlsite "$w" || exit 1
      PYTHONPATH=/tmp/verlsite python3 tools/peers/fa2_check.py | tee "$OUT/fa2_check.json" ;;
    vllm_part)  # one part of the vLLM kit a call (tools/peers/prepare_vllm.sh; carry .carry/vllm/vllm-partK, the last
      # call also .carry/vllm/vllm-deps and .carry/vllm/SHA256SUMS): collected under $VK, in the folders as carried
      mkdir -p $VK && cp -r .carry/vllm/. $VK/ && (cd $VK && ls -d */* SHA256SUMS 2>/dev/null | tr '\n' ' '); echo ;;
    vllm_kit)  # vLLM for TRL's colocate generation: the parts joined and checked against SHA256SUMS, installed --no-deps
      # into /tmp/vllmsite with vllm-deps and the SGLang kit's wheels marked [kit] in tools/peers/wheels_vllm.txt
      # (from /tmp/sgl: after h200_session.sh parts + install), then tools/peers/vllm_check.py (needs TRL's site: kit)
      vllm_kit || exit 1
      (. $VK/env.sh && PYTHONPATH=$PWD:${TRL_SITE:-/tmp/trlsite}:$VS timeout 300 python3 tools/peers/vllm_check.py \
         > "$OUT/vllm_check.log" 2>&1; rc=$?; grep '^{"' "$OUT/vllm_check.log" > "$OUT/vllm_check.jsonl"
       grep -v '"module_origins"' "$OUT/vllm_check.jsonl" | cut -c1-600; [ $rc = 0 ] || grep -v '^{"' "$OUT/vllm_check.log" | tail -5
       PYTHONPATH=$VS python3 -c "import vllm; print('import vllm:', vllm.__version__)") ;;
    data)  # megaforge's prompt order for the peers, and each verl variant's overrides checked by verl's validate_config
      PYTHONPATH=$MF_PATH python3 tools/peers/peer_data.py --config $RECIPE --steps "$STEPS" --out_dir $P/data || exit 1
      for v in ${VERL_VARIANTS-$V}; do  # ~15 s each; VERL_VARIANTS="" in a hold without verl
        PYTHONPATH=$MF_PATH python3 tools/peers/mapping.py verl --config $RECIPE --variant $v --steps "$STEPS" --data_dir $P/data \
          --out_dir $P/verl_$v --model.path $MODEL > $P/verl_$v.overrides
        cp $P/verl_$v.overrides "$OUT/"  # $OUT is emptied for every call: verl_start reads $P's copy
        (. /tmp/sgl/env.sh && PYTHONPATH=/tmp/verlsite:$PYTHONPATH python3 tools/peers/verl_compose.py $P/verl_$v.overrides \
          --out "$OUT/verl_$v.composed.yaml" | tail -1)
      done ;;
    mf_start)  # megaforge's recipe for MF_STEPS steps in this hold: no checkpoint until the end, evaluated in the run after
      # its last step only (the config refuses eval.sets never evaluated); HF exports every MF_EXPORT_EVERY steps
      # (outside the step times), graded by tools/evaluate.py in the peer's eval stage
      rm -rf /tmp/runs/peers_mf
      launch mf /tmp/runs/peers_mf/metrics.jsonl env PYTHONPATH=$MF_PATH python3 -m torch.distributed.run --nproc_per_node 1 \
        launchers/grpo.py $(mf_flags) --rollout.engine_env "$(engine_env)" ${MF_FLAGS:-} ;;
    mf_watch)
      watch_run mf /tmp/runs/peers_mf/metrics.jsonl
      python3 tools/peers/parse_logs.py megaforge /tmp/runs/peers_mf/metrics.jsonl --run "$HOLD" --stamps $P/mf.stamps \
        --launch_t "$(cat $P/mf.launch_t)" --out "$OUT/megaforge_${HOLD}_steps.jsonl" ;;
    verl_start)  # verl 0.9.1 in the SGLang kit's environment, verl's site first; its metrics as JSON lines
      mkdir -p $P/verl_$V
      launch verl_$V $P/verl_$V/metrics.jsonl env VERL_FILE_LOGGER_PATH=$P/verl_$V/metrics.jsonl bash -c \
        "set -f; . /tmp/sgl/env.sh && export PYTHONPATH=/tmp/verlsite:$PWD:\$PYTHONPATH:/tmp/mfsite && \
         exec python3 -m verl.trainer.main_ppo \$(cat $P/verl_$V.overrides)" ;;  # set -f: [console,file] is no glob
    verl_watch)
      watch_run verl_$V $P/verl_$V/metrics.jsonl
      cp $P/verl_$V/metrics.jsonl "$OUT/verl_${V}_metrics.jsonl" 2>/dev/null
      python3 tools/peers/parse_logs.py verl $P/verl_$V/metrics.jsonl --run "$HOLD-verl-$V" --stamps $P/verl_$V.stamps \
        --launch_t "$(cat $P/verl_$V.launch_t)" --out "$OUT/verl_${HOLD}_${V}_steps.jsonl" ;;
    eval_verl)  # verl's HF exports at steps 20, 10 and the base model (step 0; EVAL_BASE=0: not) through the same evaluator
      pkill -9 -f "raylet|gcs_server|ray::" 2>/dev/null; sleep 2  # Ray's workers, if any outlived verl's driver
      nvidia-smi --query-gpu=memory.used --format=csv,noheader
      base=(); [ "${EVAL_BASE:-1}" = 0 ] || base=("base 0 $MODEL verl:$HOLD-verl-$V,megaforge:$HOLD")
      mapfile -t mf < <(mf_specs)
      evaluate "verl_$V 20 $P/verl_$V/ckpt/global_step_20/actor/huggingface verl:$HOLD-verl-$V" \
        "verl_$V 10 $P/verl_$V/ckpt/global_step_10/actor/huggingface verl:$HOLD-verl-$V" \
        "${mf[@]}" "${base[@]}" ;;
    trl_start)  # TRL on the machine's own transformers (the kit's /tmp/site off its path); TRL_VLLM=1: vLLM colocate
      # generation from $VS (vllm_kit), with $VK/env.sh's environment
      vllm=""; site=/tmp/trlsite
      if [ "${TRL_VLLM:-0}" = 1 ]; then
        [ -f $VK/env.sh ] || { echo "[h200_peers] trl_start: TRL_VLLM=1 needs vllm_kit first"; exit 1; }
        . $VK/env.sh; vllm=--use_vllm; site=/tmp/trlsite:$VS
      fi
      launch trl $P/trl/trl_steps.jsonl env PYTHONPATH=$PWD:$site:/tmp/mfsite python3 tools/peers/trl_grpo.py --config $RECIPE \
        --data $P/data/train.jsonl --steps "$STEPS" --out_dir $P/trl --run "$TRL_RUN" --save_every ${TRL_SAVE_EVERY:-10} --model.path $MODEL $vllm \
        --variant ${TRL_VARIANT:-mapped} ;;
    trl_watch)
      watch_run trl $P/trl/trl_steps.jsonl
      cp $P/trl/trl_steps.jsonl "$OUT/trl_${HOLD}_steps.jsonl" 2>/dev/null ;;
    eval_trl)
      base=(); [ "${EVAL_BASE:-1}" = 0 ] || base=("base 0 $MODEL trl:$TRL_RUN,megaforge:$HOLD")
      mapfile -t mf < <(mf_specs)
      evaluate "trl 20 $P/trl/checkpoint-80 trl:$TRL_RUN" "trl 10 $P/trl/checkpoint-40 trl:$TRL_RUN" \
        "trl 5 $P/trl/checkpoint-20 trl:$TRL_RUN" \
        "${mf[@]}" "${base[@]}" ;;
    bundle)  # the device brings back at most 8 files a call: $OUT's files and the hold's logs, metrics and per-prompt
      # grades in one $OUT/<HOLD>_bundle.tgz (the peers' checkpoints and data left out); last, after compare
      b=$(basename $P); tar czf /tmp/${HOLD}_bundle.tgz --exclude="$b/trl/checkpoint-*" --exclude="$b/verl_*/ckpt" --exclude="$b/data" \
        -C $(dirname $P) $(basename $P) -C /tmp $(cd /tmp && ls -d runs/peers_mf/metrics.jsonl runs/peers_mf/logs 2>/dev/null) \
        -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/${HOLD}_bundle.tgz "$OUT/" && ls -l "$OUT" ;;
    compare)
      python3 tools/peers/compare.py $(ls "$OUT"/*_steps.jsonl "$OUT"/eval_*.jsonl 2>/dev/null) --png "$OUT/peers_pass1.png" --json "$OUT/peers_summary.jsonl" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
