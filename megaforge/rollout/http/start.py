"""Starting HTTP engines: ``rollout.num_engines`` servers (SGLang or megaforge's embedded one), GPUs,
the router, and the :class:`megaforge.rollout.http.engine.HTTPEngine` over them (with its weight snapshot
for fault tolerance, :mod:`megaforge.rollout.http.recovery`)."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megaforge.configtree import ConfigError
from megaforge.hf import load_hf_model
from megaforge.net import is_loopback
from megaforge.planner.layout import engine_gpus
from megaforge.rollout.http.auth import engine_api_key
from megaforge.rollout.http.engine import HTTPEngine
from megaforge.rollout.http.processes import ServerProcess, start_all
from megaforge.specs import EngineSpec, expect
from megaforge.supervise import child_env, pin_gpus
from megaforge.rollout.http.versions import TESTED as SGLANG_TESTED  # noqa: F401  (release -> how it was tested)
from megaforge.rollout.http.versions import UnsupportedServer, caps_for_release

ROUTER_TESTED = "0.3.2"
_VERSION_PROBE = ("import importlib.metadata as m, sys\n"
                  "for p in sys.argv[1:]:\n"
                  "    try: print(p, m.version(p))\n"
                  "    except m.PackageNotFoundError: print(p, '-')\n")


def engine_python(spec) -> str:
    return spec.rollout.engine_python or sys.executable


def engine_env(spec) -> dict:
    """Environment of an engine server or router: this process's without torchrun's rendezvous
    variables, ``rollout.engine_env`` on top (megaforge's tree not put on ``PYTHONPATH``: the engine's
    interpreter imports its own packages). Each server's GPUs are pinned over it
    (:func:`megaforge.supervise.pin_gpus`, by :func:`build_http_engine`)."""
    return child_env(None, dict(spec.rollout.engine_env), repo_on_path=False)


def installed_versions(spec, packages: tuple[str, ...]) -> dict[str, Optional[str]]:
    """{package: version or None} as the engine interpreter (``rollout.engine_python`` with
    ``rollout.engine_env``) sees them."""
    py = engine_python(spec)
    try:
        out = subprocess.run([py, "-c", _VERSION_PROBE, *packages], env=engine_env(spec), capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"config key 'rollout.engine_python': cannot run {py!r}: {e}") from None
    if out.returncode != 0:
        raise ConfigError(f"config key 'rollout.engine_python': {py!r} failed (exit {out.returncode}) while reading "
                          f"package versions: {out.stderr.strip()[-800:]}")
    found = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines() if " " in line)
    return {p: (None if found.get(p, "-") == "-" else found[p]) for p in packages}


def require_sglang(spec, router: bool = False) -> str:
    """The sglang release the engine interpreter runs; fails early, naming what to install, when
    sglang (or the router) is missing there or older than megaforge supports."""
    pkgs = ("sglang",) + (("sglang-router",) if router else ())
    found = installed_versions(spec, pkgs)
    where = f"the engine interpreter {engine_python(spec)}" + (" with rollout.engine_env" if spec.rollout.engine_env else "")
    missing = [p for p, v in found.items() if v is None]
    if missing:
        tested = ", ".join(f"sglang=={v}" for v in SGLANG_TESTED) + (f", sglang-router=={ROUTER_TESTED}" if router else "")
        raise ConfigError(f"rollout.engine 'sglang'{' with rollout.router' if router else ''} needs {', '.join(missing)}, "
                          f"which {where} does not have: pip install 'megaforge[sglang]' there, or point "
                          f"rollout.engine_python / rollout.engine_env at an environment that has it (tested: {tested})")
    try:
        caps_for_release(found["sglang"])
    except UnsupportedServer as e:
        raise ConfigError(f"rollout.engine 'sglang': {where} has sglang {found['sglang']}: {e}") from None
    return found["sglang"]


def gpu_assignment(num_engines: int, tp: int, num_gpus: int, local_world: int, visible: Optional[list[int]]) -> list[list[int]]:
    """GPU ids (as the parent sees them, mapped through its CUDA_VISIBLE_DEVICES) of each engine: the
    planner's placement (:func:`megaforge.planner.layout.engine_gpus`) on this one node.

    Colocated (``num_gpus == 0``): engines share the trainer's GPUs, engine k on GPUs
    ``[k*tp, (k+1)*tp)``. Disaggregated: the last ``num_gpus`` GPUs of the node are the rollout GPUs;
    they must not overlap the trainer's ``local_world`` ones. All engines run on this (the main rank's)
    node.
    """
    need = num_engines * tp
    if num_gpus and need > num_gpus:
        raise ValueError(f"rollout.num_engines x rollout.tensor_parallel = {need} GPUs > rollout.num_gpus = {num_gpus}")
    n = len(visible) if visible is not None else (local_world + num_gpus if num_gpus else need)
    base = 0 if num_gpus == 0 else n - num_gpus
    if num_gpus and base < local_world:
        raise ValueError(f"rollout.num_gpus = {num_gpus} rollout GPUs and {local_world} trainer processes do not fit "
                         f"the {len(visible) if visible is not None else '?'} GPUs of this node")
    if base + need > n:
        raise ValueError(f"rollout engines need GPUs {base}..{base + need - 1} but only {n} are visible")
    ids = visible if visible is not None else list(range(n))
    return [[ids[g] for _, g in gpus] for gpus in engine_gpus(num_engines, tp, num_gpus, 1, n)]


def visible_gpus() -> Optional[list[int]]:
    """The GPU ids this process sees: ``CUDA_VISIBLE_DEVICES`` when set, else all (None without CUDA)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [int(x) for x in env.split(",") if x.strip()]
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else None


def _model_dir(spec) -> tuple[str, list[str]]:
    """The policy's initial weights as a folder the servers can load (a random init is written out)."""
    if spec.model.path:
        return spec.model.path, []
    d = tempfile.mkdtemp(prefix="megaforge-engine-init-")
    # a seeded random init made on the GPU where there is one (seconds, not minutes, for a 2B model); the
    # loop overwrites the engines' weights with the trainer's before the first rollout anyway
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = load_hf_model(spec.model, dev)
    model.should_save_on_this_rank = lambda is_main_process: True  # transformers writes on dist rank 0 only; every node leader needs its copy
    model.save_pretrained(d)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return d, [d]


def weight_roots(configured: list[str], snapshot_dir: str, disk_transport: bool, max_restarts: int) -> list[str]:
    """``--weight-root`` directories of an embedded server bound beyond loopback: ``configured``
    (``rollout.weight_roots``) plus where megaforge itself writes weights for ``/update_weights_from_disk``
    (``rollout.snapshot_dir``, else, with the disk transport or restarts, the temporary folder that holds
    default snapshots and the disk transport's shards)."""
    own = [snapshot_dir] if snapshot_dir else []
    if disk_transport or (max_restarts > 0 and not snapshot_dir):
        own.append(tempfile.gettempdir())
    return [os.path.abspath(d) for d in list(configured) + own]


@dataclass(frozen=True)
class ServerStart:
    """What every server of one start shares: the weights' and tokenizer's folders, the API key, the
    ``--weight-root`` folders (:func:`weight_roots`) and the device the engines run on."""

    model_dir: str
    tok_dir: str
    api_key: str
    roots: list[str]
    device: torch.device


@dataclass(frozen=True)
class Servers:
    """The servers of one HTTP engine kind (its module's, e.g. megaforge.rollout.http.sglang):
    ``command(spec, start, port, fd)`` a server's command line (``start``: :class:`ServerStart`),
    ``env(spec, start)`` the environment its servers share (each server's ``CUDA_VISIBLE_DEVICES`` is
    set on top by :func:`build_http_engine` from the placement); ``hold_socket``: the server takes its listening socket
    ``fd`` from this process (else it binds ``port`` itself); ``health_probe``: the endpoint of the health
    check at the start of every step (:mod:`megaforge.rollout.http.recovery`), one the server answers only
    when its engine loop answers."""

    command: Callable[..., list[str]]
    env: Callable[..., dict]
    hold_socket: bool = False
    health_probe: str = "/health_generate"


def build_http_engine(spec: EngineSpec, tokenizer, kind: Servers, device: torch.device,
                      node=None) -> Optional[HTTPEngine]:
    """Start ``rollout.num_engines`` servers of ``kind``, wait until they are ready, optionally put the
    router in front; logs in ``<run dir>/logs/engine_K.log``. ``device``: where the kind's engines run
    (its ``build`` says: ``rollout.device`` for a kind that runs there, megaforge.engine_kinds
    ``on_device``, else CUDA); on CUDA they are placed by :func:`gpu_assignment`. ``node``
    (:class:`megaforge.placement.NodeEngines`, multi-node jobs): start only this node's engines
    (``node.engine_ids`` on ``node.gpus``); the URLs of all nodes' engines are gathered and rank 0 gets
    the engine, other node leaders None (``node`` keeps their servers).

    One downward pass from ``spec`` to the servers' start (issue 42 point 7,
    tests/rollout/test_engine_launch_walk.py): the pieces every server shares (:class:`ServerStart` and
    the kind's environment, ``kind.env``), then each server's GPUs (``CUDA_VISIBLE_DEVICES``, set over
    the shared environment) and command line (``kind.command``, called by :meth:`ServerProcess.start`
    with the port it binds)."""
    r = expect(spec, EngineSpec, "build_http_engine").rollout
    loopback = is_loopback(r.host)  # no API key needed, no --weight-root folders
    api_key = engine_api_key(r.api_key, loopback)
    if node is not None:
        api_key = node.share(api_key)  # rank 0's key on every node
    model_dir, cleanup = _model_dir(spec)
    tok_dir = spec.model.tokenizer or spec.model.path or ""
    local = lambda p: os.path.abspath(p) if p and os.path.exists(p) else p  # noqa: E731  (hub ids stay)
    model_dir, tok_dir = local(model_dir), local(tok_dir)
    logs = os.path.join(spec.run_dir, "logs")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ids = list(range(r.num_engines)) if node is None else node.engine_ids
    gpus = (gpu_assignment(r.num_engines, r.tensor_parallel, r.num_gpus, local_world, visible_gpus()) if node is None
            else node.gpus) if device.type == "cuda" else [None] * len(ids)
    gpus = dict(zip(ids, gpus))
    roots = [] if loopback else weight_roots(r.weight_roots, r.snapshot_dir, spec.transport == "disk", r.max_restarts)
    start = ServerStart(model_dir, tok_dir, api_key, roots, device)
    env = kind.env(spec, start)  # every server's; CUDA_VISIBLE_DEVICES per server below
    servers = [ServerProcess(f"engine_{k}", functools.partial(kind.command, spec, start),
                             os.path.join(logs, f"engine_{k}.log"), host=r.host, env=pin_gpus(env, gpus[k]),
                             hold_socket=kind.hold_socket, api_key=api_key) for k in ids]
    try:
        start_all(servers, r.startup_timeout_s)
        urls = [s.url for s in servers] if node is None else node.gather(servers, cleanup)
        if urls is None:
            return None  # a node leader other than rank 0: node stops its servers at the end
        router_url = None
        if r.router and r.num_engines > 1:
            router = ServerProcess("router", lambda port, fd: [
                engine_python(spec), "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--host", "127.0.0.1",
                "--port", str(port)] + (["--api-key", api_key] if api_key else []),
                os.path.join(logs, "router.log"), env=engine_env(spec), api_key=api_key, probe="/health")
            router.start_ready(r.startup_timeout_s)
            servers.append(router)
            router_url = router.url
    except BaseException:
        for s in servers:
            s.stop(grace_s=3.0)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
        raise
    return HTTPEngine(urls, api_key, router_url, r.request_timeout_s, spec.transport,
                      [r.tensor_parallel] * len(urls), servers, model_dir, cleanup, max_restarts=r.max_restarts,
                      snapshot_dir=r.snapshot_dir, health_timeout_s=r.health_timeout_s,
                      startup_timeout_s=r.startup_timeout_s, health_probe=kind.health_probe)
