"""Launching HTTP engines: ``rollout.num_engines`` servers (SGLang or megaforge's embedded one), GPUs,
the router, and the :class:`megaforge.rollout.sglang.HTTPEngine` over them (with its weight snapshot
for fault tolerance, :mod:`megaforge.rollout.recovery`)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Optional

import torch

from megaforge.rollout.sglang import HTTPEngine

SGLANG_TESTED = {"sglang": "0.5.23", "sglang-router": "0.3.2"}


def require_sglang(router: bool = False) -> None:
    """Fail early, naming the extra to install, when the sglang packages are missing."""
    import importlib.metadata
    import importlib.util
    import warnings

    from megaforge.configtree import ConfigError

    need = [("sglang", "sglang")] + ([("sglang-router", "sglang_router")] if router else [])
    missing = [pkg for pkg, mod in need if importlib.util.find_spec(mod) is None]
    if missing:
        pins = ", ".join(f"{k}=={v}" for k, v in SGLANG_TESTED.items())
        raise ConfigError(f"rollout.engine 'sglang'{' with rollout.router' if router else ''} needs {', '.join(missing)}, "
                          f"which is not installed: pip install 'megaforge[sglang]' (tested with {pins})")
    for pkg, _ in need:
        v = importlib.metadata.version(pkg)
        if v != SGLANG_TESTED[pkg]:
            warnings.warn(f"{pkg} {v} is installed; megaforge is tested with {pkg}=={SGLANG_TESTED[pkg]}")


def gpu_assignment(num_engines: int, tp: int, num_gpus: int, local_world: int, visible: Optional[list[int]]) -> list[list[int]]:
    """GPU ids (as the parent sees them, mapped through its CUDA_VISIBLE_DEVICES) of each engine.

    Colocated (``num_gpus == 0``): engines share the trainer's GPUs, engine k on GPUs
    ``[k*tp, (k+1)*tp)``. Disaggregated: the last ``num_gpus`` GPUs of the node are the rollout GPUs
    (the placement :mod:`megaforge.planner.layout` reports); they must not overlap the trainer's
    ``local_world`` ones. All engines run on this (the main rank's) node.
    """
    need = num_engines * tp
    if num_gpus and need > num_gpus:
        raise ValueError(f"rollout.num_engines x rollout.tensor_parallel = {need} GPUs > rollout.num_gpus = {num_gpus}")
    base = 0 if num_gpus == 0 else (len(visible) - num_gpus if visible is not None else local_world)
    if num_gpus and base < local_world:
        raise ValueError(f"rollout.num_gpus = {num_gpus} rollout GPUs and {local_world} trainer processes do not fit "
                         f"the {len(visible) if visible is not None else '?'} GPUs of this node")
    if visible is not None and base + need > len(visible):
        raise ValueError(f"rollout engines need GPUs {base}..{base + need - 1} but only {len(visible)} are visible")
    ids = visible if visible is not None else list(range(base + need))
    return [ids[base + k * tp: base + (k + 1) * tp] for k in range(num_engines)]


def _visible_gpus() -> Optional[list[int]]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [int(x) for x in env.split(",") if x.strip()]
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else None


def _model_dir(cfg) -> tuple[str, list[str]]:
    """The policy's initial weights as a folder the servers can load (a random init is written out)."""
    if cfg.model.path:
        return cfg.model.path, []
    from megaforge.hf import load_hf_model

    d = tempfile.mkdtemp(prefix="megaforge-engine-init-")
    model = load_hf_model(cfg.model, torch.device("cpu"))
    model.should_save_on_this_rank = lambda is_main_process: True  # transformers writes on dist rank 0 only; every node leader needs its copy
    model.save_pretrained(d)
    return d, [d]


def weight_roots(cfg) -> list[str]:
    """``--weight-root`` directories of an embedded server bound beyond loopback: ``rollout.weight_roots``
    plus where megaforge itself writes weights for ``/update_weights_from_disk`` (``rollout.snapshot_dir``,
    else the temporary folder that holds default snapshots and the disk transport's shards)."""
    r = cfg.rollout
    own = [r.snapshot_dir] if r.snapshot_dir else []
    if cfg.sync.transport == "disk" or (r.max_restarts > 0 and not r.snapshot_dir):
        own.append(tempfile.gettempdir())
    return [os.path.abspath(d) for d in list(r.weight_roots) + own]


def build_http_engine(cfg, tokenizer, kind: str, node=None) -> Optional[HTTPEngine]:
    """Launch ``rollout.num_engines`` servers of ``kind`` (``embedded_server`` | ``sglang``), wait until
    they are ready, optionally put the router in front; logs in ``<run dir>/logs/engine_K.log``.
    ``node`` (:class:`megaforge.placement.NodeEngines`, multi-node jobs): launch only this node's
    engines (``node.engine_ids`` on ``node.gpus``); the URLs of all nodes' engines are gathered and
    rank 0 gets the engine, other node leaders None (``node`` keeps their servers)."""
    from megaforge.hf import resolve_device
    from megaforge.rollout.launcher import ServerProcess, child_env, start_all
    from megaforge.rollout.server import API_KEY_ENV, is_loopback, new_api_key

    r = cfg.rollout
    if kind == "sglang":
        require_sglang(router=r.router and r.num_engines > 1)
    elif r.tensor_parallel != 1:
        raise ValueError("rollout.tensor_parallel: the embedded server runs TP 1 (use rollout.num_engines)")
    elif r.router and r.num_engines > 1:
        require_sglang(router=True)
    api_key = r.api_key or ("" if is_loopback(r.host) else new_api_key())
    if node is not None:
        api_key = node.share(api_key)  # rank 0's key on every node
    model_dir, cleanup = _model_dir(cfg)
    tok_dir = cfg.model.tokenizer or cfg.model.path or ""
    local = lambda p: os.path.abspath(p) if p and os.path.exists(p) else p  # noqa: E731  (hub ids stay)
    model_dir, tok_dir = local(model_dir), local(tok_dir)
    logs = os.path.join(cfg.run_dir, "logs")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = resolve_device(r.device) if kind == "embedded_server" else torch.device("cuda")
    ids = list(range(r.num_engines)) if node is None else node.engine_ids
    gpus = (gpu_assignment(r.num_engines, r.tensor_parallel, r.num_gpus, local_world, _visible_gpus()) if node is None
            else node.gpus) if device.type == "cuda" else [None] * len(ids)
    gpus = dict(zip(ids, gpus))
    roots = [] if is_loopback(r.host) else weight_roots(cfg)
    servers = []
    for k in ids:
        if kind == "embedded_server":
            def cmd(port, fd, k=k):
                c = [sys.executable, "-m", "megaforge.rollout.server", "--model", model_dir, "--host", r.host,
                     "--port", str(port), "--sock-fd", str(fd), "--device", "cuda" if device.type == "cuda" else "cpu",
                     "--dtype", cfg.model.dtype, "--attn-implementation", cfg.model.attn_implementation,
                     "--max-batch", str(r.engine_batch_size), "--weight-version", "0"]
                c += [a for root in roots for a in ("--weight-root", root)]
                return c + (["--tokenizer", tok_dir] if tok_dir else []) + list(r.extra_args)
            env = child_env(gpus[k], {API_KEY_ENV: api_key} if api_key else None)
        else:
            def cmd(port, fd, k=k):
                c = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", r.host,
                     "--port", str(port), "--tp-size", str(r.tensor_parallel), "--mem-fraction-static", str(r.mem_fraction),
                     "--dtype", cfg.model.dtype, "--weight-version", "0", "--random-seed", str(cfg.seed)]
                c += ["--tokenizer-path", tok_dir] if tok_dir else []
                c += ["--enable-memory-saver"] if r.num_gpus == 0 else []
                c += ["--api-key", api_key] if api_key else []
                return c + list(r.extra_args)
            env = child_env(gpus[k])
        servers.append(ServerProcess(f"engine_{k}", cmd, os.path.join(logs, f"engine_{k}.log"), host=r.host, env=env,
                                     hold_socket=kind == "embedded_server", api_key=api_key))
    try:
        start_all(servers, r.startup_timeout_s)
        urls = [s.url for s in servers] if node is None else node.gather(servers, cleanup)
        if urls is None:
            return None  # a node leader other than rank 0: node stops its servers at the end
        router_url = None
        if r.router and r.num_engines > 1:
            router = ServerProcess("router", lambda port, fd: [
                sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--host", "127.0.0.1",
                "--port", str(port)] + (["--api-key", api_key] if api_key else []),
                os.path.join(logs, "router.log"), env=child_env(), api_key=api_key, probe="/health")
            router.start_ready(r.startup_timeout_s)
            servers.append(router)
            router_url = router.url
    except BaseException:
        for s in servers:
            s.stop(grace_s=3.0)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
        raise
    return HTTPEngine(urls, api_key, router_url, r.request_timeout_s, cfg.sync.transport,
                      [r.tensor_parallel] * len(urls), servers, model_dir, cleanup, max_restarts=r.max_restarts,
                      snapshot_dir=r.snapshot_dir, health_timeout_s=r.health_timeout_s,
                      startup_timeout_s=r.startup_timeout_s)
