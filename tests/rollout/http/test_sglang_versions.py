"""SGLang compatibility as a tested matrix (megaforge.rollout.http.versions): the client derives what a
server can do from its release and speaks each release's weight-update API. On the CPU the client
runs against megaforge's embedded server speaking the 0.5.16 and the 0.5.23 API (``--sglang-api``:
0.5.16 has no /begin_weight_update and takes updates without a session; 0.5.23 refuses updates
outside one and has no /get_weight_version); the real 0.5.16 server is exercised by tests/gpu.
Also here: engine servers never inherit torchrun's rendezvous variables, and rollout.engine_python /
rollout.engine_env select the interpreter whose sglang is checked and launched."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine_helpers import engine_config, hf_output_logprobs, http, perturbed_state
from megaforge.build import RunBuilder

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------------------- caps
@pytest.mark.parametrize("version,session", [("0.5.16", False), ("0.5.20", False), ("0.5.21", True),
                                             ("0.5.23", True), ("0.5.15.post1", None), ("0.4.9", None)])
def test_caps_follow_the_release(version, session):
    from megaforge.rollout.http.versions import UnsupportedServer, caps_from_server_info

    if session is None:
        with pytest.raises(UnsupportedServer, match="older than the oldest release"):
            caps_from_server_info({"version": version})
        return
    caps = caps_from_server_info({"version": version})
    assert caps.frontend == "sglang" and caps.weight_update_session is session and caps.weights_checker


def test_caps_of_the_embedded_server_and_unknown_servers():
    from megaforge.rollout.http.versions import UnsupportedServer, caps_from_server_info

    emb = caps_from_server_info({"frontend": "megaforge-embedded", "version": "0.1.0", "sglang_api": "0.5.16"})
    assert not emb.weight_update_session and emb.weights_checksum and not emb.weights_checker
    with pytest.raises(UnsupportedServer, match="no 'version'"):
        caps_from_server_info({"model_path": "x"}, "http://h:1")


# --------------------------------------------------------------------- the client, per release
@pytest.mark.parametrize("api", ["0.5.16", "0.5.23"])
def test_weight_update_speaks_each_release(api, long_model_dir, tmp_path, tokenizer):
    from megaforge.rollout import build_engine
    from megaforge.types import GenerateRequest, SamplingParams

    eng = build_engine(RunBuilder(engine_config(tmp_path, long_model_dir, extra_args=["--sglang-api", api])).engine_spec(), tokenizer)
    try:
        url = eng.clients[0].url
        assert eng.caps[0].weight_update_session is (api == "0.5.23")
        # the endpoint sets of the release: 0.5.16 has /get_weight_version and no session endpoints
        assert http(url, "POST", "/begin_weight_update", {})[0] == (404 if api == "0.5.16" else 200)
        if api == "0.5.23":
            assert http(url, "POST", "/end_weight_update", {})[0] == 200
        assert http(url, "GET", "/get_weight_version")[0] == (200 if api == "0.5.16" else 404)
        model, named = perturbed_state(long_model_dir, seed=5)
        eng.update_weights([named[: len(named) // 2], named[len(named) // 2:]], 7)  # shm buckets (CPU tensors)
        assert eng.weight_version == 7
        prompt = [5, 17, 33, 9]
        c = eng.generate([GenerateRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3,
                                                                 stop_token_ids=[]), rid="a")])[0]
        ref = hf_output_logprobs(model, prompt, c.output_ids)
        # fp32 forward of a 2-layer model, server vs in-test HF: same kernels, different batch shapes
        assert (ref - torch.tensor(c.output_logprobs)).abs().max().item() <= 1e-4
    finally:
        eng.shutdown()


# ------------------------------------------------------------------------- server environments
def test_servers_never_inherit_torchruns_rendezvous(monkeypatch, tmp_path):
    from megaforge.rollout.http.processes import ServerProcess
    from megaforge.supervise import child_env, is_rendezvous_var

    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "ROLE_RANK": "0", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_ERROR_FILE": "/e"}
    for k, v in torchrun.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MEGAFORGE_KEEP_ME", "1")
    out = tmp_path / "env.json"
    cmd = lambda port, fd: [sys.executable, "-c", f"import os, json; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"]
    p = ServerProcess("engine_0", cmd, str(tmp_path / "engine_0.log"),
                      env=child_env([3], {"PYTHONPATH": "/opt/sglang-site"}, repo_on_path=False)).start()
    p.proc.wait(30)
    env = json.loads(out.read_text())
    assert not [k for k in env if is_rendezvous_var(k)], sorted(k for k in env if is_rendezvous_var(k))
    assert env["MEGAFORGE_KEEP_ME"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["PYTHONPATH"] == "/opt/sglang-site"  # rollout.engine_env replaces the trainer's path


def test_each_server_gets_its_gpus_over_the_shared_environment():
    from megaforge.supervise import child_env, pin_gpus

    shared = child_env(extra={"PYTHONPATH": "/opt/sglang-site"}, repo_on_path=False)
    before = dict(shared)
    pinned = [pin_gpus(shared, g) for g in ([0, 1], [2, 3])]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in pinned] == ["0,1", "2,3"]
    assert all(e["PYTHONPATH"] == "/opt/sglang-site" for e in pinned)
    assert shared == before  # the shared environment is not changed by a server's pin
    assert pin_gpus(shared, None) is shared  # off CUDA: no pin


def _fake_dist(root, name: str, version: str) -> str:
    """A site folder where ``importlib.metadata`` finds ``name`` at ``version`` (its real lookup)."""
    d = root / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(root)


def test_engine_python_and_env_select_the_sglang_that_is_checked(tmp_path, long_model_dir):
    from megaforge.configtree import ConfigError
    from megaforge.rollout.http.start import installed_versions, require_sglang

    cfg = engine_config(tmp_path, long_model_dir, engine="sglang")
    cfg.rollout.engine_env = {"PYTHONPATH": _fake_dist(tmp_path / "new", "sglang", "0.5.16")}
    assert require_sglang(RunBuilder(cfg).engine_spec()) == "0.5.16"
    assert installed_versions(RunBuilder(cfg).engine_spec(), ("sglang", "sglang-router")) == {"sglang": "0.5.16", "sglang-router": None}
    with pytest.raises(ConfigError, match="needs sglang-router.*rollout.engine_python"):
        require_sglang(RunBuilder(cfg).engine_spec(), router=True)
    cfg.rollout.engine_env = {"PYTHONPATH": _fake_dist(tmp_path / "old", "sglang", "0.5.10")}
    with pytest.raises(ConfigError, match="sglang 0.5.10.*older than the oldest release"):
        require_sglang(RunBuilder(cfg).engine_spec())
    cfg.rollout.engine_python = str(tmp_path / "no-such-python")
    with pytest.raises(ConfigError, match="rollout.engine_python.*cannot run"):
        require_sglang(RunBuilder(cfg).engine_spec())
    # an interpreter that exists: a virtualenv's python is found the same way
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    _fake_dist(type(tmp_path)(site), "sglang", "0.5.23")
    cfg.rollout.engine_python, cfg.rollout.engine_env = str(venv / "bin" / "python"), {}
    assert require_sglang(RunBuilder(cfg).engine_spec()) == "0.5.23"
    assert os.path.exists(cfg.rollout.engine_python)
