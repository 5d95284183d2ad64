"""tools/peers/h200_peers.sh's functions on the CPU (issue 39 point 1; sourced with no stage, the script only
defines them): evaluate's shared tools/evaluate.py call with its one-model fallback, mf_flags through the recipe's
config checks (--dry_run), and vllm_kit's install of the parted vLLM wheel with the SGLang kit's wheels."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_h200_peers_evaluate_shares_one_engine_start_and_falls_back_to_one_alone(tmp_path):
    """h200_peers.sh's evaluate on the CPU (embedded engine, tiny models, the demo config in place of the
    recipe): the models share one tools/evaluate.py call; a model missing from its output (here: another
    architecture, refused after the first was graded) is evaluated alone; a missing folder is skipped."""
    from tests.conftest import make_tiny_model

    a = make_tiny_model(str(tmp_path / "a"), seed=1)
    wide = make_tiny_model(str(tmp_path / "wide"), seed=1, intermediate_size=96)
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Compute {x} times 7.", "answer": str(7 * x)}) + "\n" for x in range(2)))
    env = dict(os.environ, OUT=str(tmp_path / "out"), PEERS_DIR=str(tmp_path / "p"), RECIPE="configs/demo_cpu.yaml",
               EVAL_DATA=str(data), ENGINE_ENV_JSON="{}", MF_PATH=ROOT, OMP_NUM_THREADS="1",
               EVAL_FLAGS="--rollout.max_new_tokens 4 --data.max_prompt_len 64 --k 0 --eval.check_disjoint false")
    script = (f'source tools/peers/h200_peers.sh; evaluate "s 20 {a} verl:h1-v" "s 10 {tmp_path}/none verl:h1-v" '
              f'"w 0 {wide} verl:h1-v,megaforge:h1"')
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"no HF folder at {tmp_path}/none" in r.stdout
    assert f"{wide}: not in the shared call's output; evaluated alone" in r.stdout
    out = tmp_path / "out"
    s20 = [json.loads(x) for x in open(out / "eval_s_20.jsonl")]
    w0 = [json.loads(x) for x in open(out / "eval_w_0.jsonl")]
    assert [(e["system"], e["run"], e["step"], e["prompts"]) for e in s20] == [("verl", "h1-v", 20, 2.0)]
    assert [(e["system"], e["run"], e["step"]) for e in w0] == [("verl", "h1-v", 0), ("megaforge", "h1", 0)]
    assert (out / "eval_s_20_samples.jsonl.gz").stat().st_size > 0 and (out / "eval_w_0_samples.jsonl.gz").stat().st_size > 0
    log = next(out.glob("eval_*.log")).read_text()
    assert "config.json intermediate_size" in log  # the shared call's refusal of the second model, then its own call


def test_h200_peers_megaforge_flags_pass_the_recipe_config_check():
    """mf_start's launcher flags, as the GPU machine gets them, through the recipe's --dry_run (the config checks
    a run makes before it starts). Hold 2 lost a launch to a flag set the config refuses (eval.sets never
    evaluated: eval.interval 0 with eval.before_train false); this catches that on the CPU."""
    env = dict(os.environ, MF_STEPS="50", MF_EXPORT_EVERY="10", OUT="/tmp/h200-peers-flags-out",
               PEERS_DIR="/tmp/h200-peers-flags")
    flags = subprocess.run(["bash", "-c", "source tools/peers/h200_peers.sh; mf_flags"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert flags.returncode == 0, flags.stderr
    argv = flags.stdout.split()
    assert argv[argv.index("--max_steps") + 1] == "50" and argv[argv.index("--export_hf_every") + 1] == "10"
    r = subprocess.run([sys.executable, "launchers/grpo.py", *argv, "--dry_run", "--model_config",
                        "configs/models/qwen2.5-coder-0.5b", "--gpus_per_node", "1", "--gpu", "H200",
                        "--memory.offload", "auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "memory.offload auto -> none" in r.stdout


def _wheel(folder, dist: str, version: str, tag: str = "py3-none-any", module: str | None = None) -> str:
    """A minimal installable wheel ``dist-version-tag.whl`` with one module (``__version__`` = version)."""
    import zipfile
    name = dist.replace("-", "_")
    path = os.path.join(str(folder), f"{name}-{version}-{tag}.whl")
    info = f"{name}-{version}.dist-info"
    files = {f"{module or name}/__init__.py": f"__version__ = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def test_h200_peers_vllm_kit_joins_the_parts_and_takes_the_sglang_kits_wheels(tmp_path):
    """h200_peers.sh's vllm_kit install on the CPU, with stand-in wheels laid out as prepare_vllm.sh lays out
    .carry/vllm (the vLLM wheel in parts, vllm-deps, SHA256SUMS) and the SGLang kit's /tmp/sgl holding the
    [kit] pins of tools/peers/wheels_vllm.txt: it refuses a missing part and a missing kit wheel, joins the parts
    in order, installs everything into VLLM_SITE and writes env.sh."""
    import hashlib
    lines = [ln for ln in open(os.path.join(ROOT, "tools", "peers", "wheels_vllm.txt")) if "==" in ln.split("#")[0]]
    pins = [ln.split("#")[0].strip() for ln in lines]
    kit = [ln.split("#")[0].strip() for ln in lines if "[kit]" in ln]
    assert "vllm==0.26.0" in pins and "xgrammar==0.2.1" in kit and "pydantic-core==2.50.5" in kit
    vk, sgl, site, build = tmp_path / "vk", tmp_path / "sgl", tmp_path / "site", tmp_path / "build"
    for d in (vk / "vllm-deps", sgl, build):
        d.mkdir(parents=True)
    big = _wheel(build, "vllm", "0.26.0", "cp38-abi3-manylinux_2_28_x86_64")
    data = open(big, "rb").read()
    name = os.path.basename(big)
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    sums = [f"{hashlib.sha256(data).hexdigest()}  {name}\n"]
    for k in range(3):
        (vk / f"vllm-part{k + 1}").mkdir()
        part = vk / f"vllm-part{k + 1}" / f"{name}.part_0{k}"
        part.write_bytes(data[cut[k]:cut[k + 1]])
        sums.append(f"{hashlib.sha256(part.read_bytes()).hexdigest()}  vllm-part{k + 1}/{part.name}\n")
    dep = _wheel(vk / "vllm-deps", "cloudpickle", "3.1.3")
    sums.append(f"{hashlib.sha256(open(dep, 'rb').read()).hexdigest()}  vllm-deps/{os.path.basename(dep)}\n")
    (vk / "SHA256SUMS").write_text("".join(sums))
    for req in kit:
        dist, version = req.split("==")
        _wheel(sgl, dist.lower(), version, module=f"kit_{dist.replace('-', '_')}")
    env = dict(os.environ, OUT=str(tmp_path / "out"), PEERS_DIR=str(tmp_path / "p"), VLLM_KIT=str(vk),
               VLLM_SITE=str(site), SGL_WHEELS=str(sgl))
    run = lambda: subprocess.run(["bash", "-c", "source tools/peers/h200_peers.sh; vllm_kit"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=300)
    part3 = vk / "vllm-part3" / f"{name}.part_02"
    part3.rename(tmp_path / "away")
    r = run()
    assert r.returncode != 0 and f"vllm_kit: 2 of 3 parts under {vk}" in r.stdout
    (tmp_path / "away").rename(part3)
    moved = next(sgl.glob("xgrammar-0.2.1-*.whl"))
    moved.rename(tmp_path / moved.name)
    r = run()
    assert r.returncode != 0 and f"vllm_kit: xgrammar==0.2.1 not in {sgl}" in r.stdout
    (tmp_path / moved.name).rename(moved)
    r = run()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"vllm_kit: {name} + 1 wheels + {len(kit)} of the SGLang kit's into {site}" in r.stdout
    assert (site / "vllm" / "__init__.py").read_text() == "__version__ = '0.26.0'\n"
    assert (site / "cloudpickle").is_dir() and (site / "kit_xgrammar").is_dir() and (site / "kit_pydantic_core").is_dir()
    assert not (vk / name).exists()  # the joined wheel is removed once installed
    assert "VLLM_NO_USAGE_STATS=1" in (vk / "env.sh").read_text()
