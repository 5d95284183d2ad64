"""Security (issue 10, point 5): engine servers on loopback by default and admin endpoints behind a
token beyond it; checkpoints load with weights_only=True (a crafted checkpoint with a valid manifest
is refused, naming the file, and runs nothing), torch.distributed.checkpoint metadata included;
plug-ins come only from the config the user passes, never from a run directory."""
import os
import re
import pickle
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tests", "rollout"))
sys.path.insert(0, os.path.join(ROOT, "tests", "rollout", "http"))
# the admin-endpoint check lives with the server-process tests; listed here too, as the issue lists it
from test_processes import test_non_loopback_bind_needs_api_key_and_admin_needs_token as admin_check  # noqa: E402

DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
ARGS = ["--config", DEMO, "--sft.max_steps", "0", "--rollout.batch_size", "2", "--grpo.n_samples", "2",
        "--rollout.max_new_tokens", "6", "--metrics.progress", "false", "--metrics.tensorboard", "false"]


@pytest.mark.slow  # ~6 s; the very same test runs by default as tests/rollout/http/test_processes.py::test_non_loopback_bind_needs_api_key_and_admin_needs_token
def test_admin_endpoint_without_token_on_non_loopback_bind_is_401(tmp_path, tiny_model_dir):
    admin_check(tmp_path, tiny_model_dir)


class Evil:
    """Unpickling this creates ``path``: code run by the loader."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_engine_servers_bind_loopback_by_default():
    from megaforge.config import Config
    from megaforge.net import is_loopback
    from megaforge.rollout.server.cli import parse_args

    assert parse_args(["--model", "m"]).host == "127.0.0.1" and Config().rollout.host == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("node7")
    import inspect

    from megaforge.rollout.http import start as http_start

    assert '"--host", "127.0.0.1"' in inspect.getsource(http_start.build_http_engine)  # the router


def run(out, name, *extra, marker=""):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + HERE, MEGAFORGE_TEST_EVIL_MARKER=marker)
    return subprocess.run([sys.executable, os.path.join(ROOT, "launchers", "grpo.py"), *ARGS, "--output_dir", out,
                           "--run_name", name, *extra], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_crafted_checkpoint_is_refused_and_run_dir_config_is_not_imported(tmp_path):
    from megaforge.checkpoint import write_manifest

    out, marker = str(tmp_path), str(tmp_path / "ran")
    p = run(out, "s", "--max_steps", "1", "--checkpoint.keep_last_n", "3")
    assert p.returncode == 0, p.stderr[-2000:]
    run_dir = tmp_path / "s"
    # a run directory's config names a plug-in: --resume uses the config given, never this one (it only
    # compares the two: the change is named, refused, then allowed; the plug-in is never imported)
    cfg = (run_dir / "config.yaml").read_text().replace("plugins: []", "plugins: [evil_plugin]")
    assert "evil_plugin" in cfg
    (run_dir / "config.yaml").write_text(cfg)
    p = run(out, "s", "--max_steps", "2", "--checkpoint.keep_last_n", "3", "--resume", marker=marker)
    assert p.returncode == 1 and "--resume: algo.plugins changed" in p.stderr, p.stderr[-2000:]
    p = run(out, "s", "--max_steps", "2", "--checkpoint.keep_last_n", "3", "--resume", "--resume_allow_changes",
            "algo.plugins", marker=marker)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "config change algo.plugins: ['evil_plugin'] -> [] (allowed by resume_allow_changes)" in p.stdout
    assert not os.path.exists(marker)
    # the newest checkpoint's weights replaced by a pickle that runs code; the manifest rewritten to match
    ckpt = run_dir / "checkpoints" / "step_000002"
    sd = torch.load(ckpt / "trainer" / "trainer.pt", weights_only=True)
    sd["sched"] = Evil(marker)
    torch.save(sd, ckpt / "trainer" / "trainer.pt")
    write_manifest(str(ckpt))
    before = sorted(os.listdir(run_dir)), (run_dir / "metrics.jsonl").read_text()
    p = run(out, "s", "--max_steps", "3", "--checkpoint.keep_last_n", "3", "--resume")
    assert p.returncode != 0
    assert re.search(re.escape(f"checkpoint file {ckpt / 'trainer' / 'trainer.pt'} was refused: its pickle names global ")
                     + r"(io|builtins)\.open", p.stderr), p.stderr[-2000:]
    assert not os.path.exists(marker)  # nothing ran
    assert (sorted(os.listdir(run_dir)), (run_dir / "metrics.jsonl").read_text()) == before


@pytest.fixture(scope="module")
def mcore_checkpoint(tmp_path_factory):
    pytest.importorskip("megatron.core")
    from megaforge.net import free_port

    d = str(tmp_path_factory.mktemp("mcore") / "ckpt")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, os.path.join(HERE, "mcore_ckpt.py"), d], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert {".metadata", "common.pt"} <= set(os.listdir(d))
    return d


def test_megatron_dist_checkpoint_passes_and_crafted_files_are_refused(mcore_checkpoint, tmp_path):
    import shutil

    from megaforge.checkpoint import CheckpointRefused, check_loadable

    check_loadable(mcore_checkpoint)  # megatron-core's real files: metadata classes, tensors, containers
    marker = str(tmp_path / "ran")
    for name, write in ((".metadata", lambda f: pickle.dump(Evil(marker), f)),
                        ("common.pt", lambda f: torch.save({"iteration": 5, "x": Evil(marker)}, f))):
        d = str(tmp_path / name.strip("."))
        shutil.copytree(mcore_checkpoint, d)
        with open(os.path.join(d, name), "wb") as f:
            write(f)
        with pytest.raises(CheckpointRefused, match=f"checkpoint file {d}/{name} was refused: its pickle names "
                                                    f"global (io|builtins).open"):
            check_loadable(d)
        assert not os.path.exists(marker)
    # torch's own reader would have run it: the .metadata check is what stands in the way
    from torch.distributed.checkpoint import FileSystemReader

    FileSystemReader(os.path.join(str(tmp_path), "metadata")).read_metadata()
    assert os.path.exists(marker)


def test_forced_unsafe_torch_load_is_refused(tmp_path, monkeypatch):
    from megaforge.checkpoint import CheckpointRefused, check_loadable

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointRefused, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set"):
        check_loadable(str(tmp_path))


def test_no_shell_strings():
    """Commands are argument lists: no call in the package passes shell=True or uses os.system /
    os.popen / subprocess.getoutput (so no model output can reach a shell)."""
    import ast

    bad = []
    for d, _, files in os.walk(os.path.join(ROOT, "megaforge")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput"):
                    bad.append(f"{path}:{node.lineno}: {name}")
                bad += [f"{path}:{node.lineno}: shell=True" for k in node.keywords
                        if k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)]
    assert bad == []
