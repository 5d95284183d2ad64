"""tools/check_lora_run.py: a LoRA run's merged HF export against its base and PEFT adapter folder, bit
for bit; a base weight that moved (or an export of other adapters) fails with exit status 1."""
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_lora_run  # noqa: E402


def _run(tiny_model_dir, tmp_path):
    """A run folder as a LoRA run with --export_hf_every writes it: source_model/, adapter/step_2/, hf/step_2/."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from megaforge.config.model import LoraConfig
    from megaforge.sync.adapters import merge_lora
    from megaforge.trainer.lora import peft_config

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "source_model")
    lcfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])
    pm = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), peft_config(lcfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(str(run / "adapter" / "step_2"))
    ad = load_file(str(run / "adapter" / "step_2" / "adapter_model.safetensors"))
    base = load_file(str(run / "source_model" / "model.safetensors"))
    merged = {}
    for name, w in base.items():
        mod = name[: -len(".weight")]
        a = ad.get(f"base_model.model.{mod}.lora_A.weight")
        merged[name] = merge_lora(w, a, ad[f"base_model.model.{mod}.lora_B.weight"], 2.0) if a is not None else w
    os.makedirs(run / "hf" / "step_2")
    save_file(merged, str(run / "hf" / "step_2" / "model.safetensors"))
    return run, base


def test_export_equal_to_base_plus_adapters_passes_and_a_moved_base_fails(tiny_model_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    run, base = _run(tiny_model_dir, tmp_path)
    assert check_lora_run.newest_step(str(run)) == 2
    assert check_lora_run.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "step 2: merged export == W0 + s B A bit for bit for 4 adapted weights" in out and "loaded" in out
    # one float of a non-adapted base weight moved by an ulp: the export no longer matches the base
    moved = dict(base)
    moved["model.norm.weight"] = torch.nextafter(base["model.norm.weight"], torch.full_like(base["model.norm.weight"], 9))
    save_file(moved, str(run / "source_model" / "model.safetensors"))
    assert check_lora_run.main([str(run)]) == 1
    assert "model.norm.weight: the export differs from the base" in capsys.readouterr().err
    # an adapted weight's base moved
    moved = dict(base)
    q = "model.layers.0.self_attn.q_proj.weight"
    moved[q] = torch.nextafter(base[q], torch.full_like(base[q], 9))
    save_file(moved, str(run / "source_model" / "model.safetensors"))
    assert check_lora_run.main([str(run), "--step", "2"]) == 1
    assert f"{q}: the export differs from W0 + s B A" in capsys.readouterr().err
