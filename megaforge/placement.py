"""Rollout engines over the nodes of a torchrun job: which node starts which engine on which GPUs
(the dry-run planner's placement, :func:`megaforge.planner.layout.placement`, applied at run time),
and how the main rank reaches them.

Rules (the planner's, for ``N`` nodes of ``G`` GPUs, ``G = LOCAL_WORLD_SIZE + rollout.num_gpus / N``):

* colocated (``rollout.num_gpus == 0``): engine ``k`` (TP ``t``) takes GPUs ``[k*t, (k+1)*t)``
  counted node-major over all GPUs, i.e. the same GPUs as trainer ranks ``k*t .. (k+1)*t - 1``;
* disaggregated: every node gives its last ``rollout.num_gpus / N`` GPUs to engines, the first
  ``LOCAL_WORLD_SIZE`` to trainer ranks;
* ``rollout.engine: embedded`` lives in the rank-0 process.

One process per node starts that node's engine servers: its local rank 0 (the *node leader*). The
API key is chosen on rank 0 and broadcast; the servers' URLs are gathered on every rank
(``all_gather_object``) and rank 0 builds the one :class:`megaforge.rollout.http.engine.HTTPEngine` over
all of them (engine order = engine id). One node (the common case) keeps the single-process path:
rank 0 starts every engine (its kind's ``build``, megaforge.engine_kinds).

Across hosts: servers must listen on an address rank 0 reaches (``rollout.host 0.0.0.0``: the URL
then carries this node's address, ``MEGAFORGE_NODE_ADDR`` or the host name's address), and weights
travel by ``sync.transport nccl`` (``disk`` on a shared file system); shared-memory transports need
one host. Engines of other nodes are health-checked by rank 0 but restarted only by their own node,
i.e. not by rank 0's fault tolerance (their failure fails the step). Their servers stop when the run
ends (after a barrier, so rank 0's engine shut down first), when their leader exits (``atexit``), or
with their leader (PDEATHSIG).
"""
from __future__ import annotations

import os
import shutil
import socket
from typing import Callable, Optional

import torch.distributed

from megaforge import collective
from megaforge.cluster import Job, ProcessPlace, place_from_env
from megaforge.configtree import ConfigError
from megaforge.engine_kinds import call, engine_kind
from megaforge.net import is_loopback
from megaforge.planner.layout import Hardware, check_layout, placement
from megaforge.planner.shapes import ShapeError, read_shape
from megaforge.rollout.http.start import visible_gpus
from megaforge.specs import EngineSpec, PlanInput, expect

_WILDCARD = ("0.0.0.0", "::", "")


def hardware(num_gpus: int, place: ProcessPlace):
    """The planner's Hardware of this job: N nodes x (local ranks + rollout GPUs per node);
    ``num_gpus``: ``rollout.num_gpus``."""
    per_node = num_gpus // place.nodes if num_gpus else 0
    return Hardware(place.nodes, place.local_world + per_node, "runtime", 0.0)


def engine_slots(pin: PlanInput, place: ProcessPlace) -> dict[int, list[tuple[int, list[int]]]]:
    """{node: [(engine id, node-local GPU indices in TP-rank order), ...]} from the planner's placement of
    ``pin`` (:meth:`megaforge.build.RunBuilder.plan_input`). Raises ConfigError with the planner's messages
    when the layout cannot work."""
    expect(pin, PlanInput, "engine_slots")
    try:
        shape = read_shape(pin.model)
    except ShapeError as e:
        raise ConfigError(f"engine placement needs the model's shape: {e}") from None
    hw = hardware(pin.rollout.num_gpus, place)
    lay, errs, _ = check_layout(pin, shape, hw, "grpo")
    if lay is None:
        raise ConfigError("engine placement over " + f"{hw.nodes} node(s) x {hw.gpus_per_node} GPUs: "
                          + "; ".join(str(e) for e in errs))
    if lay.world != place.world:
        raise ConfigError(f"the layout has {lay.world} trainer ranks but torchrun started {place.world}: "
                          f"rollout.num_gpus={pin.rollout.num_gpus} over {place.nodes} node(s)")
    slots: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for row in placement(lay, hw):
        e = row.get("engine")
        if e is not None and not e.get("in_process"):
            slots.setdefault(row["node"], {}).setdefault(e["id"], []).append((e["tp_rank"], row["gpu"]))
    return {n: sorted((k, [g for _, g in sorted(v)]) for k, v in per.items()) for n, per in slots.items()}


def node_address() -> str:
    """The address other nodes use for servers of this node bound to a wildcard address."""
    if os.environ.get("MEGAFORGE_NODE_ADDR"):
        return os.environ["MEGAFORGE_NODE_ADDR"]
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


class NodeEngines:
    """This process's part in starting a multi-node set of engines, handed to
    the ``build`` of the engine kind (megaforge.engine_kinds, ``node=``) on node leaders; every other
    rank makes the same two collective calls (:meth:`share`, :meth:`gather`) with nothing to add."""

    def __init__(self, spec: EngineSpec, place: ProcessPlace, slots: dict):
        self.spec, self.place = expect(spec, EngineSpec, "NodeEngines"), place
        mine = slots.get(place.node, []) if place.node_leader else []
        self.engine_ids = [k for k, _ in mine]
        visible = visible_gpus()
        self.gpus = [[visible[g] if visible is not None else g for g in gs] for _, gs in mine]
        self.servers: list = []
        self.cleanup: list[str] = []

    def share(self, api_key: str) -> str:
        """Rank 0's API key on every rank (one key for every engine)."""
        return collective.broadcast_object(api_key)

    def _url(self, server) -> str:
        host = self.spec.rollout.host
        if host in _WILDCARD:
            addr = node_address()
            return f"http://[{addr}]:{server.port}" if ":" in addr else f"http://{addr}:{server.port}"
        return server.url

    def gather(self, servers: list, cleanup: list[str] = ()) -> Optional[list[str]]:
        """Every engine's URL in engine-id order on rank 0 (None on other ranks). ``servers``: the
        started servers of this node (in ``engine_ids`` order); they stay this object's to stop."""
        self.servers, self.cleanup = list(servers), list(cleanup)
        mine = [(k, self._url(s)) for k, s in zip(self.engine_ids, self.servers)]
        box: list = [None] * collective.world()
        torch.distributed.all_gather_object(box, (self.place.node, socket.gethostname(), mine))
        main_host = box[0][1]
        urls = sorted((k, u, h, n) for n, h, part in box for k, u in part)
        r = self.spec
        remote = sorted({h for _, _, h, _ in urls if h != main_host})
        if remote and r.rollout.host not in _WILDCARD and is_loopback(r.rollout.host):
            raise ConfigError(f"rollout.host {r.rollout.host} is a loopback address but engines run on other hosts "
                              f"({', '.join(remote)}): set rollout.host 0.0.0.0 so rank 0 reaches them")
        if remote and r.transport in ("auto", "shm", "ipc"):
            raise ConfigError(f"sync.transport {r.transport}: engines on other hosts ({', '.join(remote)}) cannot "
                              f"map this host's memory; use sync.transport nccl (or disk on a shared file system)")
        if [k for k, *_ in urls] != list(range(r.rollout.num_engines)):
            raise ConfigError(f"engines started: {[k for k, *_ in urls]}, expected 0..{r.rollout.num_engines - 1}")
        if collective.is_main():
            self.servers, self.cleanup = [], []  # rank 0's HTTPEngine owns its node's servers
            print("[megaforge] engines: " + ", ".join(f"engine_{k} {u} (node {n}, {h})" for k, u, h, n in urls), flush=True)
            return [u for _, u, _, _ in urls]
        return None

    def shutdown(self) -> None:
        for s in reversed(self.servers):
            s.stop()
        self.servers = []
        for d in self.cleanup:
            shutil.rmtree(d, ignore_errors=True)
        self.cleanup = []

    def end(self, barrier: bool) -> None:
        """End of run: stop the servers this node's leader started for rank 0. ``barrier``: every rank
        got here together (the run finished or stopped), so wait until rank 0 shut its engine down."""
        if barrier and collective.initialized():
            collective.barrier()
        self.shutdown()


def build_engines(spec: EngineSpec, tokenizer, job: Optional[Job] = None,
                  slots: Optional[Callable[[ProcessPlace], dict]] = None):
    """Called on every rank by the loop: the engine rank 0 drives (None on other ranks), built by the
    kind of ``spec.rollout.engine`` from ``spec``. Node leaders of a multi-node job start their node's
    engine servers (see the module docstring) on the GPUs ``slots(place)`` gives them
    (:func:`engine_slots` through :meth:`megaforge.build.RunBuilder.engines`); ``job`` stops them when the
    run ends (:meth:`NodeEngines.end`; without one, the process's exit does)."""
    spec = expect(spec, EngineSpec, "build_engines")
    place, kind, node = place_from_env(), engine_kind(spec.rollout.engine), None
    if place.nodes > 1 and not kind.in_process:
        if slots is None:
            raise ValueError("build_engines: a multi-node job needs slots (the planner's placement: "
                             "megaforge.build.RunBuilder.engines passes it)")
        node = NodeEngines(spec, place, slots(place))
        if job is not None:
            job.at_end(node.end)
    if collective.is_main() or (node is not None and place.node_leader and node.engine_ids):
        return call(kind.build, spec, tokenizer, **({} if node is None else {"node": node}))
    if node is not None:  # a rank that starts no engine still takes part in the start's collective calls
        node.share("")
        node.gather([])
    return None
