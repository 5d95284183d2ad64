"""tools/gpu/h200_session.sh's GSM8K-shaped runs on the CPU: the argv gsm_start / gsm_chunk launch (sourced
with no stage, the script only defines its functions), put through the launcher's config checks and --dry_run as
the GPU machine would get them: the GRPO recipe, the recipe with the LoRA flags of issue 43 (a), and the
distillation recipe of issue 43 (c). A hold loses a launch (~2 min of SGLang start-up) to a flag or config the
checks refuse; these catch it here. Also: two runs get their own folder, log and pid file, and the summary line
of a finished run (on hold 2's committed metrics)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = "configs/grpo_gsm8k_qwen2.5_0.5b_h200.yaml"
DISTILL = "configs/distill_gsm8k_qwen2.5_0.5b_h200.yaml"
LORA_FLAGS = "--model.lora.rank 32 --model.lora.alpha 64 --trainer.lr 3e-5 --max_steps 50"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def session(tmp_path, script: str, **env) -> subprocess.CompletedProcess:
    """``script`` run in bash after sourcing the session script (no stage), with ``env`` on top of a CPU's."""
    full = dict(os.environ, OUT=str(tmp_path / "out"), ENGINE_ENV_JSON='{"SGL_KIT": "1"}', **env)
    return subprocess.run(["bash", "-c", f"source tools/gpu/h200_session.sh; {script}"], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)


def launched_argv(tmp_path, **env) -> tuple[list[str], str]:
    r = session(tmp_path, 'gsm_argv && printf "%s\\n" "${argv[@]}" && echo "RUN=$GSM_RUN LOG=$GSM_LOG PID=$GSM_PID"', **env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    return lines[:-1], lines[-1]


CASES = {
    "grpo": ({}, GRPO, "grpo_gsm8k_qwen2.5_0.5b_h200", []),
    "lora": ({"GSM_NAME": "grpo_gsm8k_lora", "GSM_FLAGS": LORA_FLAGS}, GRPO, "grpo_gsm8k_lora", []),
    "distill": ({"GSM_CONFIG": DISTILL}, DISTILL, "distill_gsm8k_qwen2.5_0.5b_h200",
                ["--teacher_config", "configs/models/qwen2.5-coder-1.5b"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gsm_runs_launch_what_the_config_checks_accept(tmp_path, case):
    env, config, name, plan_flags = CASES[case]
    argv, paths = launched_argv(tmp_path, **env)
    assert argv[:5] == ["python3", "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    i = argv.index("launchers/grpo.py")
    assert argv[i + 1:i + 7] == ["--config", config, "--output_dir", "/tmp/runs", "--run_name", name]
    assert argv[argv.index("--rollout.engine_env") + 1] == '{"SGL_KIT": "1"}'
    assert "--resume" not in argv  # no checkpoints of that run here
    assert " ".join(argv).endswith(env.get("GSM_FLAGS", '{"SGL_KIT": "1"}'))
    assert paths == f"RUN=/tmp/runs/{name} LOG=/tmp/mf/{name}.log PID=/tmp/mf/{name}.pid"
    r = subprocess.run([sys.executable, *argv[i:], "--dry_run", "--model_config", "configs/models/qwen2.5-coder-0.5b",
                        *plan_flags, "--gpus_per_node", "1", "--gpu", "H200"],
                       cwd=ROOT, env=dict(os.environ, **OFFLINE), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verdict   OK" in r.stdout and "memory.offload auto -> none" in r.stdout
    assert ("LoRA adapters weights" in r.stdout) == (case == "lora")
    assert ("teacher weights (frozen)" in r.stdout) == (case == "distill")


def test_gsm_argv_refuses_a_config_that_is_not_there(tmp_path):
    r = session(tmp_path, "gsm_argv", GSM_CONFIG="configs/no_such_recipe.yaml")
    assert r.returncode == 1 and "GSM_CONFIG=configs/no_such_recipe.yaml: no such config" in r.stderr


def test_gsm_summary_of_a_finished_run(tmp_path):
    """Hold 2's 50 steps (docs/benchmarks): its median step and train time as docs/benchmarks/README.md gives them."""
    r = session(tmp_path, "gsm_summary docs/benchmarks/peers_h100_hold2_megaforge_metrics.jsonl")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[h200_session] grpo_gsm8k_qwen2.5_0.5b_h200: 50 steps, median step 6.22 s (rollout 2.56")
    assert "peak GiB train 38.8 rollout 10.6 sync 12.3" in r.stdout and r.stdout.rstrip().endswith("greedy pass@1 50:0.3434")


def test_kits_script_refuses_an_unknown_kit_before_writing_anything(tmp_path):
    """tools/gpu/kits.sh checks every kit name first: a typo exits 2 naming the valid kits, and neither
    .git/info/exclude nor any kit folder is touched (a copy of the repository's tools, in a scratch git repository)."""
    import shutil

    repo = tmp_path / "r"
    shutil.copytree(os.path.join(ROOT, "tools"), repo / "tools")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    before = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*"))
    p = subprocess.run(["bash", "tools/gpu/kits.sh", "gsm", "tep"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown kit 'tep' (sglang, gsm, teacher, te, fa3, peers)" in p.stdout
    assert sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*")) == before


def test_gsm_start_waits_for_the_detached_student_conversion(tmp_path):
    """gsm_prep_detached converts the student in its own process session while the next calls carry the teacher's
    parts; gsm_start / gsm_chunk first wait for it (wait_detached_prep): they go on when it ended with exit 0, and stop
    on a failed or killed conversion, or one still running at the time limit, naming it (a run would otherwise start
    on a model folder that is not there yet). A short `sleep` stands in for the conversion's process."""
    files = {k: str(tmp_path / f"prep.{k}") for k in ("pid", "rc", "log")}
    env = {"PREP_PID": files["pid"], "PREP_RC": files["rc"], "PREP_LOG": files["log"]}
    with open(files["log"], "w") as f:
        f.write("[h200_session] Qwen2.5-Coder-0.5B-Instruct -> /tmp/x: exit 1 in 3 s\n")

    def run(rc, sleep_s=2, limit=30):
        write_rc = f"echo {rc} > {files['rc']}" if rc is not None else f"rm -f {files['rc']}"
        script = (f"(sleep {sleep_s}; {write_rc}) & echo $! > {files['pid']}; "
                  f"wait_detached_prep {limit}; echo \"rc=$?\"")
        return session(tmp_path, script, **env)

    ok = run(0)
    assert ok.stdout.rstrip().endswith("rc=0") and "waited" in ok.stdout, ok.stdout + ok.stderr
    bad = run(1)
    assert bad.stdout.rstrip().endswith("rc=1") and "ended with exit 1" in bad.stdout and "exit 1 in 3 s" in bad.stdout
    # the stage of the same name, on that failed conversion (a call that runs h200_peers.sh data during the conversion, then mf_start)
    stage = subprocess.run(["bash", "tools/gpu/h200_session.sh", "gsm_prep_wait"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, OUT=str(tmp_path / "out"), **env))
    assert stage.returncode == 1 and "ended with exit 1" in stage.stdout, stage.stdout + stage.stderr
    killed = run(None)
    assert killed.stdout.rstrip().endswith("rc=1") and "killed?" in killed.stdout
    slow = run(0, sleep_s=5, limit=1)
    assert slow.stdout.rstrip().endswith("rc=1") and "still runs after 1 s" in slow.stdout
    gone = session(tmp_path, "wait_detached_prep; echo \"rc=$?\"", PREP_PID=str(tmp_path / "none.pid"))
    assert gone.stdout.rstrip() == "rc=0"  # no detached conversion started: nothing to wait for


def test_jit_caches_saved_in_parts_and_restored_in_place(tmp_path):
    """jit_save packs the kernel-cache folders that exist into 15 MiB parts with their sums; jit_load, given those
    files as carried, checks the sums and puts every file back at its absolute path. Parts that do not match
    their sums are refused before anything is written."""
    import shutil

    triton, tvm = tmp_path / "home" / ".triton" / "cache", tmp_path / "home" / ".cache" / "tvm-ffi"
    (triton / "abc").mkdir(parents=True)
    tvm.mkdir(parents=True)
    blob = os.urandom(17 << 20)  # incompressible: two parts of at most 15 MiB
    (triton / "abc" / "kernel.cubin").write_bytes(blob)
    (tvm / "fused.so").write_bytes(b"\x7fELF" * 100)
    dirs = f"{triton} {tvm} {tmp_path / 'home' / '.cache' / 'flashinfer'}"  # the last one absent: skipped
    r = session(tmp_path, "jit_save", JIT_DIRS=dirs)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["jit_cache.SHA256SUMS", "jit_cache.tgz.00", "jit_cache.tgz.01"]
    assert max((out / f).stat().st_size for f in os.listdir(out)) <= 15 << 20
    carry = tmp_path / "carry"
    shutil.copytree(out, carry)
    shutil.rmtree(tmp_path / "home")
    r = session(tmp_path, "jit_load", JIT_DIRS=dirs, JIT_CARRY=str(carry))
    assert r.returncode == 0 and "jit_load: 2 cached files restored" in r.stdout, r.stdout + r.stderr
    assert (triton / "abc" / "kernel.cubin").read_bytes() == blob and (tvm / "fused.so").read_bytes() == b"\x7fELF" * 100
    shutil.rmtree(tmp_path / "home")
    with open(carry / "jit_cache.tgz.01", "r+b") as f:  # one byte of the second part changed
        f.seek(100)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    r = session(tmp_path, "jit_load", JIT_DIRS=dirs, JIT_CARRY=str(carry))
    assert r.returncode != 0 and "does not match its sums" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "home").exists()
    r = session(tmp_path, "rm -rf $OUT; mkdir -p $OUT; jit_save", JIT_DIRS=dirs)
    assert r.returncode != 0 and "none of" in r.stdout, r.stdout + r.stderr
