"""LoRA on the Megatron backend (``model.lora`` with ``trainer.backend: megatron``): tensor-parallel
adapters on megatron-core's own parallel linears (torch layer spec).

Why not Megatron-Bridge's LoRA: it is not installed, and cannot be here: its last release for Python
3.11 (0.3.1; later ones need Python >= 3.12) requires ``transformers<5`` (megaforge runs 5.x) and
``transformer-engine[pytorch]`` (CUDA builds; the torch spec on CPU / gloo has no TE), and it wraps
TE's linears, while megaforge's torch spec uses megatron's ColumnParallelLinear / RowParallelLinear.
PEFT (the torch backend's LoRA, :mod:`megaforge.trainer.lora`) wraps ``nn.Linear`` and knows
nothing of tensor parallelism or megatron's fused qkv / gate-up weights. So the adapters are
megaforge's own, with PEFT's formula, initialisation and names (the checkpoint and export speak PEFT).

One adapter per *Hugging Face projection* p in ``model.lora.target_modules`` (q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj; :data:`megaforge.convert.lora_names.TARGETS`), on the
megatron linear that computes p (linear_qkv, linear_proj, linear_fc1, linear_fc2), with r = rank,
s = alpha / r, A [r, in_p] and B [out_p, r] (HF's shapes of p):

    y_p = x W_p^T + s * dropout(x) A^T B^T          A ~ U(-1/sqrt(in_p), 1/sqrt(in_p)) (PEFT's Kaiming), B = 0

Fused outputs: on linear_qkv the q / k / v adapters add only to their slots of megatron's
interleaved layout (per local key/value group g: [q heads of g | k_g | v_g], through the same
:func:`megaforge.convert.layouts.fuse_qkv` as the weight converter); on linear_fc1 to the gate or up
half of each TP rank's [gate_t | up_t]. Tensor parallelism (TP size tp, rank t; x: [s, b, in] or, with
sequence parallelism, this rank's [s/tp, b, in]):

* column-parallel (q, k, v, gate, up): A replicated, B_t = rows of B of rank t ([out_p/tp, r], the rows
  of p that rank t's weight shard holds). z = x A^T [*, r]; without SP, z goes through
  copy_to_tensor_model_parallel_region (backward: all-reduce of dz over TP, so A's gradient is whole
  and equal on every rank); with SP, z of this rank's tokens is all-gathered over the sequence
  (backward: reduce-scatter), and A's gradient (one sequence shard's) is summed over TP by megatron's
  ``finalize_model_grads`` (``A.sequence_parallel``, as for norm weights). y_t = s z B_t^T [s, b, out_p/tp].
* row-parallel (o, down): A_t = columns of A of rank t [r, in_p/tp], B replicated. The partial
  z_t = x_t A_t^T is summed over TP as the base output is: all-reduce without SP
  (reduce_from_tensor_model_parallel_region), reduce-scatter over the sequence with SP (then B's
  gradient, one shard's, is summed over TP: ``B.sequence_parallel``); y = s z B^T added to the base's
  reduced output [s, b, H] (SP: [s/tp, b, H]).

The adapters of one linear run as one low-rank pair (:meth:`MegatronLora._stacked`): their A stacked
[n r, in_local], their B placed block-wise in the fused output's slots [out_local, n r], so a linear costs
z = x A^T, one TP collective of z, and out + s z B^T as one GEMM with the add inside (addmm).

Only A and B require gradients: megatron's DDP buffers and optimizers (plain or distributed) hold
them alone; the frozen base stays where it is. The engines get merged weights W + s B A per shard
(:meth:`MegatronLora.merged`, fused like the forward; base parameters untouched). Checkpoints hold
the adapters under their PEFT names and global shapes (any layout loads them:
:mod:`megaforge.convert.lora_names`, :mod:`.lora_checkpoint`). Dropout draws from torch's default
generator (every TP rank draws the same masks where x is replicated: same seed, same program).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaforge.configtree import ConfigError
from megaforge.convert import lora_names
from megaforge.convert.layouts import Dims, fuse_qkv

#: megatron linear (under decoder.layers.{j}) -> its adapted HF projections in slot order
LINEARS = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"), "self_attention.linear_proj": ("o_proj",),
           "mlp.linear_fc1": ("gate_proj", "up_proj"), "mlp.linear_fc2": ("down_proj",)}


def check_lora(lcfg, tcfg, spec: str, desc) -> None:
    """ConfigError naming the keys unless the megatron backend supports ``model.lora`` here: the torch
    layer spec (``spec``: ``trainer.layer_spec`` resolved), no FP8, HF projection names as targets, no
    MoE expert projections targeted (an MoE model's layers have no dense gate/up/down)."""
    if spec != "torch":
        raise ConfigError(f"model.lora with trainer.layer_spec {tcfg.layer_spec!r} (resolved to {spec!r}): the megatron "
                          "backend's LoRA adapters wrap megatron's own parallel linears: set trainer.layer_spec: torch")
    if tcfg.fp8:
        raise ConfigError("model.lora with trainer.fp8: the megatron backend's LoRA has no FP8 path: set trainer.fp8 null")
    bad = [t for t in lcfg.target_modules if t not in lora_names.TARGETS]
    if bad:
        raise ConfigError(f"model.lora.target_modules: {bad} on trainer.backend megatron; it takes HF projection "
                          f"names: {', '.join(lora_names.TARGETS)}")
    mlp = [t for t in lcfg.target_modules if t in ("gate_proj", "up_proj", "down_proj")]
    if desc.is_moe and mlp and any(desc.is_moe_layer(i) for i in range(desc.num_layers)):
        raise ConfigError(f"model.lora.target_modules: {mlp} would target the mixture-of-experts layers' experts, "
                          "which the megatron backend's LoRA does not adapt: target the attention projections only")


class _RowMajorGrad(torch.autograd.Function):
    """Identity whose backward hands on the gradient with row-major strides. GPTModel's logits [s, b, V]
    go out transposed to [b, s, V]; their gradient comes back as a transposed view, e.g. [s, 1, V] with
    strides (V, s V, 1). A trainable output layer flattens it; a frozen one (megatron's
    LinearWithFrozenWeight: ``grad_output.matmul(weight)``) meets torch.matmul's folding rule, which reads
    the stride of the size-1 dimension too, and computes a batched product over the s tokens with the
    [V, H] weight broadcast to each: on the 0.5B recipe's H100 run ~19 s of a 26 s step instead of ~2 s."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous().view(-1, g.shape[-1]).view(g.shape)


def _row_major_logits_grad(module, args, output):
    """Forward hook of the frozen output layer: its logits through :class:`_RowMajorGrad`."""
    logits, bias = output
    return _RowMajorGrad.apply(logits), bias


class Adapter(torch.nn.Module):
    """This rank's shards of one HF projection's A [r, in_local] and B [out_local, r]."""

    def __init__(self, proj: str, rank: int, in_local: int, out_local: int, dtype, device):
        super().__init__()
        self.proj, self.kind = proj, lora_names.TARGETS[proj][2]
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))


class MegatronLora:
    """The adapters of this rank's stage of ``bm.model`` (attached in place; base parameters frozen).

    ``rows``: :func:`megaforge.convert.lora_names.stage_table` of this stage (Megatron name, PEFT
    name, split axis per adapter tensor)."""

    def __init__(self, bm, lcfg, seed: int, sequence_parallel: bool):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        self.bm, self.lcfg = bm, lcfg
        self.scale = lcfg.alpha / lcfg.rank
        self.sp = sequence_parallel
        self.enabled = True
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        d = bm.desc
        self.local_dims = Dims(d.hidden, d.num_heads // self.tp, d.num_kv_heads // self.tp, d.head_dim, d.ffn // self.tp,
                               d.vocab, d.vocab)
        for p in bm.model.parameters():
            p.requires_grad_(False)
        pp = ps.get_pipeline_model_parallel_world_size()
        self.rows = lora_names.stage_table(d.num_layers, pp, ps.get_pipeline_model_parallel_rank(),
                                           list(lcfg.target_modules))
        targets = set(lcfg.target_modules)
        w = next(bm.model.parameters())
        for j, layer in enumerate(bm.model.decoder.layers):
            for lname, projs in LINEARS.items():
                mine = [p for p in projs if p in targets]
                if not mine:
                    continue
                linear = layer.get_submodule(lname)
                linear.lora = torch.nn.ModuleDict()
                linear.lora_slots = projs  # every slot of the fused output, adapted or not
                for proj in mine:
                    out_f, in_f = self._hf_shape(proj)
                    kind = lora_names.TARGETS[proj][2]
                    ad = Adapter(proj, lcfg.rank, in_f // (self.tp if kind == "row" else 1),
                                 out_f // (self.tp if kind == "column" else 1), w.dtype, w.device)
                    self._init(ad, j + bm.layer_offset, seed)
                    for name in ("lora_A", "lora_B"):
                        axis = lora_names.split_axis(proj, name)
                        param = getattr(ad, name)
                        if axis is not None:
                            set_tensor_model_parallel_attributes(param, True, axis, 1)
                        elif sequence_parallel:  # a gradient of one sequence shard: summed over TP
                            param.sequence_parallel = True
                    linear.lora[proj] = ad
                linear.register_forward_hook(self._hook)
        if getattr(bm.model, "output_layer", None) is not None:  # this stage computes the logits (frozen now)
            bm.model.output_layer.register_forward_hook(_row_major_logits_grad)
        self.params = dict((n, p) for n, p in bm.model.named_parameters() if ".lora." in n)
        if {r.megatron for r in self.rows} != set(self.params):
            raise RuntimeError(f"LoRA: the adapter table and the model disagree ({sorted(self.params)[:3]} ...)")

    # ------------------------------------------------------------------------------ shapes / init
    def _hf_shape(self, proj: str) -> tuple[int, int]:
        """(out, in) of HF projection ``proj``'s weight."""
        d = self.bm.desc
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        return {"q_proj": (q, d.hidden), "k_proj": (kv, d.hidden), "v_proj": (kv, d.hidden), "o_proj": (d.hidden, q),
                "gate_proj": (d.ffn, d.hidden), "up_proj": (d.ffn, d.hidden), "down_proj": (d.hidden, d.ffn)}[proj]

    @torch.no_grad()
    def _init(self, ad: Adapter, layer: int, seed: int) -> None:
        """A: PEFT's ``kaiming_uniform_(a=sqrt(5))`` = U(-1/sqrt(in), 1/sqrt(in)) of the *full* [r, in],
        drawn from a generator seeded by (seed, layer, projection): every layout starts from the same
        adapters; this rank keeps its shard. B = 0."""
        out_f, in_f = self._hf_shape(ad.proj)
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 16 + list(lora_names.TARGETS).index(ad.proj))
        bound = 1.0 / math.sqrt(in_f)
        full = torch.rand(self.lcfg.rank, in_f, generator=g, dtype=torch.float64) * 2 * bound - bound
        ad.lora_A.copy_(lora_names.shard(full, ad.proj, "lora_A", self.tp, self.tp_rank).to(ad.lora_A.dtype))

    # ------------------------------------------------------------------------------ forward
    def _stacked(self, linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapters of ``linear`` as one low-rank pair: A [n r, in_local] (the n adapters' A stacked in
        slot order) and B [out_local, n r] (adapter i's B in columns i r .. (i + 1) r - 1 of its slot's rows of
        the fused output, zeros elsewhere), so that s z B^T with z = x A^T is every adapter's update placed
        in the fused layout: one matmul pair and no [*, out] temporaries per adapter."""
        ads = list(linear.lora.values())
        r, n = self.lcfg.rank, len(ads)
        a = ads[0].lora_A if n == 1 else torch.cat([ad.lora_A for ad in ads])
        blocks = {ad.proj: F.pad(ad.lora_B, (i * r, (n - 1 - i) * r)) for i, ad in enumerate(ads)}
        return a, self._fuse(linear, blocks, 0)

    def _low_rank(self, linear, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """z = dropout(x) A^T for this rank, [*, n r]: communicated like the linear's output (column: whole
        over TP, all-gathered over the sequence with SP; row: the partial sums reduced, reduce-scattered
        over the sequence with SP). Dropout: one mask per adapter, as PEFT's separate dropout modules."""
        from megatron.core.tensor_parallel import mappings as m

        ads = list(linear.lora.values())
        if self.lcfg.dropout > 0 and ads[0].training:
            z = torch.cat([F.linear(F.dropout(x, self.lcfg.dropout, training=True), ad.lora_A) for ad in ads], -1)
        else:
            z = F.linear(x, a)
        if ads[0].kind == "column":
            return m.gather_from_sequence_parallel_region(z) if self.sp else m.copy_to_tensor_model_parallel_region(z)
        return m.reduce_scatter_to_sequence_parallel_region(z) if self.sp else m.reduce_from_tensor_model_parallel_region(z)

    def _fuse(self, linear, parts: dict, dim: int) -> torch.Tensor:
        """The adapters' ``parts`` ({proj: tensor}, at least one) placed in ``linear``'s fused output
        along ``dim`` (zeros in the slots of projections not adapted)."""
        projs = linear.lora_slots
        if len(projs) == 1:
            return parts[projs[0]]
        some = next(iter(parts.values()))
        pieces = []
        for proj, n in zip(projs, self._slot_sizes(projs)):
            t = parts.get(proj)
            if t is None:
                shape = list(some.shape)
                shape[dim] = n
                t = some.new_zeros(shape)
            pieces.append(t.movedim(dim, 0))
        fused = fuse_qkv(*pieces, self.local_dims) if len(projs) == 3 else torch.cat(pieces, 0)
        return fused.movedim(0, dim)

    def _slot_sizes(self, projs) -> list[int]:
        d = self.local_dims
        if len(projs) == 3:
            return [d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim]
        return [d.ffn, d.ffn]

    def _hook(self, linear, args, output):
        """out + s z B^T, the add inside the GEMM (addmm): out [*, out_local] (row: the reduced [*, out])."""
        if not self.enabled:
            return output
        out, bias = output
        a, b = self._stacked(linear)
        z = self._low_rank(linear, args[0], a).to(out.dtype)
        y = torch.addmm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]), b.to(out.dtype).t(), alpha=self.scale)
        return y.view(out.shape), bias

    @contextlib.contextmanager
    def reference(self, state: Optional[dict]):
        """The adapters off (``state`` None: the base, no second copy of it) or temporarily set to
        ``state`` ({Megatron name: local tensor}, e.g. the reference's adapters after a LoRA warm
        start); restored after."""
        if state is None:
            self.enabled = False
            try:
                yield
            finally:
                self.enabled = True
            return
        keep = self.local_state()
        self.load_local_state(state)
        try:
            yield
        finally:
            self.load_local_state(keep)

    # ------------------------------------------------------------------------------ state
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def local_state(self) -> dict[str, torch.Tensor]:
        """{Megatron name: a copy of this rank's adapter shard}."""
        return {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def load_local_state(self, state: dict) -> None:
        for n, p in self.params.items():
            p.copy_(state[n])

    def fresh(self) -> bool:
        """True while every B is zero on every rank (the adapted policy is the base). Collective."""
        device = next(iter(self.params.values())).device  # NCCL reduces device tensors only
        nonzero = torch.tensor([float(any(bool(p.detach().any()) for n, p in self.params.items()
                                          if n.endswith("lora_B")))], device=device)
        if dist.is_initialized():
            dist.all_reduce(nonzero)
        return nonzero.item() == 0

    @torch.no_grad()
    def load_peft_state(self, full: dict) -> None:
        """Set every adapter from full HF-shaped tensors by PEFT name (each rank takes its shards)."""
        for row in self.rows:
            t = lora_names.shard(full[row.peft], row.proj, row.ab, self.tp, self.tp_rank)
            self.params[row.megatron].copy_(t.to(self.params[row.megatron].dtype))

    def peft_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """{PEFT name: full tensor on the CPU} on global rank 0 ({} elsewhere): the adapters (or, with
        ``grads``, their reduced gradients ``main_grad``), TP shards gathered, stages collected.
        Collective (every rank, same order)."""
        from megatron.core import parallel_state as ps

        first = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        mine = {}
        for row in self.rows:
            p = self.params[row.megatron]
            t = (p.main_grad if grads else p).detach()
            if row.split_axis is not None and self.tp > 1:
                parts = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = lora_names.merge(parts, row.proj, row.ab)
            if first and self.tp_rank == 0:
                mine[row.peft] = t.cpu().clone()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        out = {}
        if dist.get_rank() == 0:
            for d in everyone:
                out.update(d)
        return out

    def sharded_state_dict(self, prefix: str = "", tensors: Optional[dict] = None) -> dict:
        """ShardedTensors of the adapters keyed ``prefix + PEFT name`` with their global (HF) shapes;
        ``tensors``: {Megatron name: local tensor} instead of the parameters (e.g. the reference's)."""
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        out = {}
        for row in self.rows:
            t = self.params[row.megatron] if tensors is None else tensors[row.megatron]
            key = prefix + row.peft
            out[key] = (make_sharded_tensor_for_checkpoint(t, key) if row.split_axis is None
                        else make_tp_sharded_tensor_for_checkpoint(t, key, tp_axis=row.split_axis))
        return out

    # ------------------------------------------------------------------------------ merged weights
    @torch.no_grad()
    def merged(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s shard as the engines need it: W + s B A (float32 sum, cast to W's
        dtype; fused like the forward) for an adapted linear's weight, else ``weight`` itself."""
        if not name.endswith(".weight"):
            return weight
        linear = self._linear_of(name[: -len(".weight")])
        if linear is None:
            return weight
        a, b = self._stacked(linear)
        delta = b.detach().float() @ a.detach().float()  # [out_local, in_local], fused like the forward
        return (weight.detach().float() + self.scale * delta).to(weight.dtype)

    def _linear_of(self, module_name: str):
        try:
            linear = self.bm.model.get_submodule(module_name)
        except AttributeError:
            return None
        return linear if isinstance(getattr(linear, "lora", None), torch.nn.ModuleDict) else None

    def adapter_pairs(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(HF module name, A, B) of every adapter, full tensors, on global rank 0 (nothing elsewhere).
        Collective."""
        state = self.peft_state()
        pre = lora_names.PEFT_PREFIX
        for name in state:
            if name.endswith(".lora_A.weight"):
                mod = name[len(pre): -len(".lora_A.weight")]
                yield mod, state[name], state[f"{pre}{mod}.lora_B.weight"]
