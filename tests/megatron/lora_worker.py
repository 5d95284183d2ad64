"""One rank of tests/megatron/test_megatron_lora.py (launched by mt_helpers.run_workers).

    python lora_worker.py SCENARIO SPEC.json OUTDIR

Scenarios (every trainer: the tiny Qwen2 ``model``, ``model.lora`` rank 4 / alpha 8 on all seven
projections, the adapters of ``adapters`` (a torch file of full tensors by PEFT name) loaded):
* ``layouts``: for every (name, model, adapters, layout) of ``runs``: logprobs, then one RL step (no clipping, plain optimizer,
  profiled: its batched matmuls over the vocabulary) and the reduced adapter gradients gathered by PEFT name; the base parameters before / after (bit-equal?),
  which parameters megatron's DDP buffers and optimizer hold.
* ``resume``: at ``layout1``, 3 straight steps; 2 steps, save, a fresh trainer loads and steps once;
  trainers at ``layout2`` and ``layout3`` load the 2-step checkpoint (logprobs, adapters) and step once;
  the PEFT folder and the merged HF weights of the 3-step trainer.
* ``dropout``: model.lora.dropout 0.5, layer 0's adapted linears (their hooks) against the adapters one by one.
Results go to OUTDIR/SCENARIO.rank{R}.pt.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from mt_helpers import make_batch, trainer_cfg, worker_main  # noqa: E402


def lora_trainer(spec, layout, res=None, **trainer):
    """The trainer with the test's adapters loaded; ``res``: record its initial adapters first."""
    from megaforge.config.model import LoraConfig
    from megaforge.build import RunBuilder
    from megaforge.trainer.megatron import MegatronTrainer

    cfg = trainer_cfg(spec["model"], layout=layout, **trainer)
    cfg.model.lora = LoraConfig(rank=4, alpha=8.0)
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    if res is not None:
        res["init"], res["init_fresh"] = tr.lora.peft_state(), tr.lora.fresh()
    tr.lora.load_peft_state(torch.load(spec["adapters"]))
    tr.optimizer.reload_model_params()  # the optimizer's copies of the loaded adapters
    return tr


def base_params(tr) -> dict:
    return {n: p.detach().clone() for n, p in tr.bm.model.named_parameters() if ".lora." not in n}


def vocab_bmm(tr, prof) -> list:
    """Input shapes of the batched matmuls of a profiled step that carry the output layer's vocabulary width:
    torch.matmul's unfolded form of [t, 1, V] @ [V, H] (the frozen weight broadcast to each token), which a
    transposed logits gradient produced before megaforge.trainer.megatron.lora._RowMajorGrad."""
    out = getattr(tr.bm.model, "output_layer", None)
    if out is None:  # a first pipeline stage: no logits here
        return []
    width = (out.weight if out.weight is not None else tr.bm.model.shared_embedding_or_output_weight()).shape[0]
    return [e.input_shapes for e in prof.events()
            if e.name == "aten::bmm" and any(len(s) == 3 and width in s[1:] for s in e.input_shapes)]


def scenario_layouts(spec, res):
    batch = make_batch()
    for name, model, adapters, layout in spec["runs"]:
        key = (name, "_".join(f"{k}{int(v)}" for k, v in sorted(layout.items())) or "dp2")
        r = {}
        tr = lora_trainer({"model": model, "adapters": adapters}, dict(layout, dist_opt=False), r, grad_clip=0.0)
        r.update(logprobs=tr.compute_logprobs(batch), adapter_numel=sum(p.numel() for p in tr.lora.parameters()),
                 stage=tr._ps().get_pipeline_model_parallel_rank())
        adapters = {id(p) for p in tr.lora.parameters()}
        r["requires_grad_are_adapters"] = {id(p) for p in tr.bm.model.parameters() if p.requires_grad} == adapters
        r["ddp_holds_adapters"] = {id(p) for b in tr.ddp.buffers for p in b.params} == adapters
        r["optimizer_holds_adapters"] = {id(p) for o in tr.inner_optimizers() for g in o.param_groups
                                         for p in g["params"]} == adapters
        before, a0 = base_params(tr), tr.lora.local_state()
        with torch.profiler.profile(record_shapes=True) as prof:
            r["metrics"] = tr.train_step(batch)
        r["vocab_bmm"] = vocab_bmm(tr, prof)
        after, a1 = base_params(tr), tr.lora.local_state()
        r["base_bit_equal"] = all(torch.equal(before[n], after[n]) for n in before)
        r["adapters_moved"] = sum(int(not torch.equal(a0[n], a1[n])) for n in a0) / len(a0)
        r["grads"] = tr.lora.peft_state(grads=True)
        res[key] = r
        tr.close()


def scenario_resume(spec, res, outdir):
    batch = make_batch()
    l1, l2 = spec["layout1"], spec["layout2"]
    a = lora_trainer(spec, l1)
    from megaforge.memory.state import megatron_parts

    adapters = {id(p) for p in a.lora.parameters()}
    res["dist_opt_holds_adapters"] = (a.cfg.trainer.distributed_optimizer and adapters == {
        id(p) for o in megatron_parts(a.optimizer) for p in o.model_param_group_index_map})
    for _ in range(3):
        a.train_step(batch)
    res["straight"] = a.lora.peft_state()
    res["straight_logprobs"] = a.compute_logprobs(batch)
    a.export_adapter(os.path.join(outdir, "adapter"))
    res["merged"] = {n: t.clone() for bucket in a.iter_hf_buckets(1 << 16) for n, t in bucket}
    a.close()

    b = lora_trainer(spec, l1)
    for _ in range(2):
        b.train_step(batch)
    b.save(os.path.join(outdir, "ck"))
    res["at_save"] = b.lora.peft_state()
    res["at_save_logprobs"] = b.compute_logprobs(batch)
    b.close()

    c = lora_trainer(spec, l1)
    c.load(os.path.join(outdir, "ck"))
    c.train_step(batch)
    res["resumed"] = c.lora.peft_state()
    c.close()

    for key, layout in (("other_layout", l2), ("third_layout", spec["layout3"])):
        d = lora_trainer(spec, layout)
        d.load(os.path.join(outdir, "ck"))
        res[f"{key}_loaded"] = d.lora.peft_state()
        res[f"{key}_logprobs"] = d.compute_logprobs(batch)
        d.train_step(batch)
        res[f"{key}_stepped"] = d.lora.peft_state()
        d.close()


def scenario_dropout(spec, res):
    """model.lora.dropout 0.5: each adapted linear of layer 0 (its forward hook on given x and base output) against
    the adapters computed one by one, dropout(x) A^T B^T s placed in the fused slots, from the same seed."""
    import torch.nn.functional as F

    from megaforge.build import RunBuilder
    from megaforge.config.model import LoraConfig
    from megaforge.trainer.megatron import MegatronTrainer
    from megaforge.trainer.megatron.lora import LINEARS

    cfg = trainer_cfg(spec["model"], layout={})
    cfg.model.lora = LoraConfig(rank=4, alpha=8.0, dropout=0.5)
    tr = MegatronTrainer(RunBuilder(cfg).trainer_spec())
    tr.lora.load_peft_state(torch.load(spec["adapters"]))
    lora, model = tr.lora, tr.bm.model
    for lname in LINEARS:
        linear = model.decoder.layers[0].get_submodule(lname)
        out_f, in_f = linear.weight.shape
        x = torch.randn(6, 1, in_f, generator=torch.Generator().manual_seed(1))
        base = torch.randn(6, 1, out_f, generator=torch.Generator().manual_seed(2))
        r = {}
        for mode in ("train", "eval"):
            model.train(mode == "train")
            torch.manual_seed(5)
            got = lora._hook(linear, (x,), (base, None))[0]
            torch.manual_seed(5)
            parts = {p: F.linear(F.linear(F.dropout(x, 0.5, training=mode == "train"), ad.lora_A), ad.lora_B) * lora.scale
                     for p, ad in linear.lora.items()}
            r[mode] = got
            r[mode + "_diff"] = float((got - (base + lora._fuse(linear, parts, -1))).abs().max())
        res[lname] = {"train_diff": r["train_diff"], "eval_diff": r["eval_diff"],
                      "dropout_moves": float((r["train"] - r["eval"]).abs().max())}
    tr.close()


if __name__ == "__main__":
    worker_main({"layouts": scenario_layouts, "resume": scenario_resume, "dropout": scenario_dropout})
