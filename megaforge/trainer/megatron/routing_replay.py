"""Routing replay: megatron-core's MoE routers route each token to the experts the rollout engine chose.

megatron-core 0.16.1 routes through ``topk_routing_with_score_function(..., router_replay=...)``: every
``TopKRouter`` built with ``moe_enable_routing_replay`` holds a ``RouterReplay`` whose
``get_replay_topk(scores, topk, ..., default_compute_topk)`` returns the (scores, expert ids) the
routing continues with. Its own replay (``REPLAY_FORWARD``) takes the ids from a target set beforehand
and gathers the scores at them. megaforge uses that hook with :class:`ReplayRouter`, a ``RouterReplay``
that reads the micro-batch's recorded routing (set per micro-batch by :func:`set_routes`), keeps the
router's own choice where there is no recording, and counts the choices that differ. It is installed on
the routers of a module by :func:`set_routes` itself (not through megatron's process-wide instance list,
which the policy, the reference and the critic would share).

Formula (Qwen3-MoE: softmax score function; z = W_r x the router logits of token x over the E experts,
I = (i_1 .. i_K) the recorded experts of the token in this layer):

    moe_router_pre_softmax False (norm_topk_prob):  p_k = exp(z_{i_k}) / sum_j exp(z_{i_j})
    moe_router_pre_softmax True:                    p_k = softmax(z)_{i_k}
    expert output = sum_k p_k FFN_{i_k}(x)

so the gradient still reaches the router weights through z at the replayed experts; without a
recording (padding, a row's last token) I = top-K(z), the router's own choice.

Diff: ``routing/replay_diff_frac`` = #{(token, layer, k): i_k not in top-K(z)} / #{(token, layer, k)
recorded}, over the recorded tokens of every MoE layer of the policy passes of a train step (all
ranks summed; TP ranks without sequence parallelism count the same tokens alike, which leaves the
fraction unchanged).

Token layout: :func:`megaforge.trainer.megatron.packing.pack` slices the batch's
``routed_experts`` [B, T, layers, K] with the tokens (rows laid end to end, CP chunks); under
sequence parallelism TP rank r's routers see rows [r n / tp, (r + 1) n / tp) of the rank's n packed
tokens (megatron's scatter along the sequence); each pipeline stage's routers take their own global
layer (``router.layer_number - 1``); expert parallelism routes before the dispatch, over global
expert ids, so it changes nothing here. Activation recompute ``full`` (routers re-run in backward)
is refused by the config.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay


class ReplayRouter(RouterReplay):
    """A layer's replay state: ``routes`` [N, K] long (its recorded expert ids of the N tokens the router
    sees), ``valid`` [N] bool (a recording exists), ``replay`` (False: only count the differences)."""

    def __init__(self):  # not in RouterReplay.global_router_replay_instances (see the module docstring)
        self.target_topk_idx = self.recorded_topk_idx = self.router_replay_action = None
        self.replay_backward_list = []
        self.routes: Optional[torch.Tensor] = None
        self.valid: Optional[torch.Tensor] = None
        self.replay = True
        self.diff = self.count = None  # device scalars, summed since reset()

    def reset(self) -> None:
        self.diff = self.count = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.routes is None:
            return own_scores, own
        routes, valid = self.routes, self.valid
        if routes.shape != own.shape:
            raise RuntimeError(f"routing replay: the router sees {own.shape[0]} tokens x top-{own.shape[1]}, the "
                               f"recorded routing has {tuple(routes.shape)} (a packing / sequence-parallel mismatch)")
        with torch.no_grad():
            miss = ((routes[:, :, None] != own[:, None, :]).all(-1) & valid[:, None]).sum()
            n = valid.sum() * topk
            self.diff = miss if self.diff is None else self.diff + miss
            self.count = n if self.count is None else self.count + n
        if not self.replay:
            return own_scores, own
        idx = torch.where(valid[:, None], routes, own)
        return scores.gather(1, idx), idx


def routers(module) -> list:
    """The TopKRouters of ``module`` (a model or its DDP wrapper), in module order (found once per module)."""
    found = module.__dict__.get("_megaforge_routers")
    if found is None:
        found = [m for m in module.modules() if isinstance(m, TopKRouter)]
        module.__dict__["_megaforge_routers"] = found
    return found


def set_routes(module, routes: Optional[torch.Tensor], sp_rank: int = 0, sp_size: int = 1, replay: bool = True) -> None:
    """Give ``module``'s routers the routing of the next forward: ``routes`` [n, layers, K] (this rank's
    packed tokens, -1 where there is none; on the module's device) or None (they route themselves).
    ``sp_rank`` / ``sp_size``: sequence-parallel position (TP rank and size when it is on, else 0 / 1)."""
    rs = routers(module)
    if routes is None:
        for r in rs:
            if isinstance(r.router_replay, ReplayRouter):
                r.router_replay.routes = r.router_replay.valid = None
        return
    n = routes.shape[0]
    if n % sp_size:
        raise ValueError(f"routing replay: {n} packed tokens do not split over {sp_size} sequence-parallel ranks")
    mine = routes[sp_rank * (n // sp_size):(sp_rank + 1) * (n // sp_size)]
    for r in rs:
        if not isinstance(r.router_replay, ReplayRouter):
            r.router_replay = ReplayRouter()
        layer = r.layer_number - 1
        if not 0 <= layer < mine.shape[1]:
            raise ValueError(f"routing replay: router of layer {r.layer_number} but the routing covers {mine.shape[1]} layers")
        if mine.shape[2] != r.topk:
            raise ValueError(f"routing replay: the routing has {mine.shape[2]} experts per token, the router top-{r.topk}")
        ids = mine[:, layer].long()
        rr = r.router_replay
        rr.valid = (ids >= 0).all(-1)
        rr.routes = ids.clamp_min(0)
        rr.replay = replay


def reset_stats(module) -> None:
    for r in routers(module):
        if isinstance(r.router_replay, ReplayRouter):
            r.router_replay.reset()


def diff_counts(module, device) -> torch.Tensor:
    """[differing choices, recorded choices] (float64, this rank's) summed over ``module``'s routers
    since :func:`reset_stats`."""
    out = torch.zeros(2, dtype=torch.float64, device=device)
    for r in routers(module):
        rr = r.router_replay
        if isinstance(rr, ReplayRouter) and rr.count is not None:
            out += torch.stack([rr.diff.double(), rr.count.double()]).to(device)
    return out
