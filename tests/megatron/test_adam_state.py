"""checkpoint._ensure_adam_state: a fresh optimizer's state materialised as its own first step makes it,
for torch AdamW (megatron's Adam without Transformer Engine) and for TE's FusedAdam (its Adam with TE).

TE cannot be installed on this CPU: ``TEFusedAdamDouble`` follows transformer_engine 2.20.2's
``transformer_engine/pytorch/optimizers/fused_adam.py`` field by field where the helper touches it:
``step`` lives in the param group, ``initialize_state(param, store_param_remainders)`` creates
``exp_avg`` / ``exp_avg_sq`` in the dtypes of ``name_to_dtype_map``, and ``state_dict`` unscales every
per-parameter key through that map (KeyError for any other key, e.g. a per-parameter ``step``: what
the H200 raised when loading a TE checkpoint into a fresh trainer). The real path runs on the GPU in
tests/gpu/test_megatron_te_cuda.py (save, then load into a new trainer).
"""
from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from megaforge.trainer.megatron.checkpoint import _ensure_adam_state


class TEFusedAdamDouble:
    def __init__(self, params, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32):
        self.param_groups = [{"params": list(params), "lr": 1e-3, "bias_correction": True}]
        self.state = defaultdict(dict)
        self.master_weights = False
        self.store_param_remainders = False
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": torch.float32}
        self.calls = []

    def initialize_state(self, param, store_param_remainders):
        self.calls.append(store_param_remainders)
        for name in ("exp_avg", "exp_avg_sq"):
            self.state[param][name] = torch.zeros_like(param, dtype=self.name_to_dtype_map[name])

    def get_unscaled_state(self, param, state_name):
        dtype = self.name_to_dtype_map[state_name]  # KeyError for a key FusedAdam does not keep
        return self.state[param][state_name].float() if dtype != torch.float32 else self.state[param][state_name]

    def state_dict(self):
        return {"state": {i: {name: self.get_unscaled_state(p, name) for name in self.state[p]}
                          for i, p in enumerate(self.param_groups[0]["params"]) if self.state[p]},
                "param_groups": self.param_groups}


def _chained(inner):
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])


def test_torch_adamw_state_is_what_its_first_step_creates():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    _ensure_adam_state(_chained(opt))
    stepped = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3)
    for q in stepped.param_groups[0]["params"]:
        q.grad = torch.zeros_like(q)
    stepped.step()
    for p, q in zip(params, stepped.param_groups[0]["params"]):
        assert sorted(opt.state[p]) == sorted(stepped.state[q]) == ["exp_avg", "exp_avg_sq", "step"]
        assert float(opt.state[p]["step"]) == 0.0
        assert torch.equal(opt.state[p]["exp_avg"], torch.zeros_like(p))
    opt.state_dict()  # describable


def test_te_fused_adam_state_through_its_initialize_state_without_a_per_parameter_step():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4)),
              torch.nn.Parameter(torch.randn(0))]
    opt = TEFusedAdamDouble(params, exp_avg_dtype=torch.bfloat16)
    done = torch.ones(5)
    opt.param_groups[0]["params"].append(done)
    opt.state[done] = {"exp_avg": torch.full((5,), 2.0), "exp_avg_sq": torch.full((5,), 3.0)}  # already stepped
    _ensure_adam_state(_chained(opt))
    assert opt.calls == [False, False]  # the two non-empty fresh parameters, no param-remainder storage
    for p in params[:2]:
        assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq"]
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and not opt.state[p]["exp_avg"].any()
    assert not opt.state[params[2]]
    assert float(opt.state[done]["exp_avg"][0]) == 2.0  # existing state is left alone
    assert "step" not in opt.param_groups[0]
    opt.state_dict()  # raised KeyError('step') when the torch AdamW layout was forced on it


# ---------------------------------------------------------------- TE's pickled FP8 state on load
def test_te_extra_state_policy_trust_sets_tes_switch_only_inside(monkeypatch):
    from megaforge.trainer.megatron.checkpoint import TE_PICKLE_ENV, te_extra_state_policy

    monkeypatch.delenv(TE_PICKLE_ENV, raising=False)
    with te_extra_state_policy("/ckpt", trust=True):
        assert os.environ[TE_PICKLE_ENV] == "1"
    assert TE_PICKLE_ENV not in os.environ
    monkeypatch.setenv(TE_PICKLE_ENV, "0")
    with te_extra_state_policy("/ckpt", trust=True):
        assert os.environ[TE_PICKLE_ENV] == "1"
    assert os.environ[TE_PICKLE_ENV] == "0"
    with te_extra_state_policy("/ckpt", trust=False):
        assert os.environ[TE_PICKLE_ENV] == "0"


def test_te_refusal_names_the_checkpoint_and_the_key_other_errors_pass():
    """The message TE 2.20 raises from set_extra_state (_extra_state.extra_state_pickle_advisory), as
    the H200 printed it; the real refusal is exercised by tests/gpu/test_megatron_te_cuda.py."""
    from megaforge.trainer.megatron.checkpoint import UntrustedCheckpointState, te_extra_state_policy

    te_says = ("Refusing to load pickled Transformer Engine extra state for TERowParallelLinear. Delayed-scaling "
               "FP8 metadata can be stored as a Python pickle, and loading it can execute arbitrary code. Only "
               "enable unsafe loading if this checkpoint is from a trusted source. To load it anyway, set "
               "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.")
    with pytest.raises(UntrustedCheckpointState, match=r"/runs/x/step_000005: .*checkpoint.trust_te_pickle: true"):
        with te_extra_state_policy("/runs/x/step_000005", trust=False):
            raise RuntimeError(te_says)
    with pytest.raises(RuntimeError, match="^size mismatch$"):
        with te_extra_state_policy("/runs/x/step_000005", trust=False):
            raise RuntimeError("size mismatch")


def test_trust_te_pickle_is_a_documented_config_key():
    from megaforge.config import config_from_dict

    base = {"model": {"config": "configs/models/tiny-qwen2"}, "max_steps": 0}
    assert config_from_dict(base).checkpoint.trust_te_pickle is False
    assert config_from_dict(dict(base, checkpoint={"trust_te_pickle": True})).checkpoint.trust_te_pickle


# ---------------------------------------------------------------- the optimizer's state as saved
def test_saved_optimizer_state_at_one_dp_rank_is_megatrons_own_without_its_copies(tiny_models, tmp_path):
    """At one data-parallel rank the fully reshardable optimizer entries megaforge saves are megatron's
    own (key, offset, shapes, dtype, replica id, values: equal), built over the optimizer's own main
    params and moments instead of megatron's gathered copies (the copies that took the H200 recipe's save
    to 59 GiB of host memory for a 24 GB checkpoint)."""
    from mt_helpers import run_workers

    (r,) = run_workers("opt_state", 1, {"model": tiny_models["qwen3"], "layout": {}}, tmp_path)
    assert r["diffs"] == [], r["diffs"][:10]
    assert r["optimizer_keys"] == ["exp_avg", "exp_avg_sq", "param"]
    n = r["optimizer_entries"]
    assert n >= 3 * 10, r  # three states of every parameter of the 2-layer Qwen3
    assert r["ours_own_storage"] == n, r  # every optimizer entry is a view of the optimizer's own tensors
    assert r["theirs_own_storage"] == 0, r  # megatron's: every one a gathered copy
