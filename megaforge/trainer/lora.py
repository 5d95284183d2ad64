"""LoRA on the torch backend (``model.lora``), through PEFT (``peft.get_peft_model``): PEFT's LoRA layers
are the well-kept implementation of the adapter forward, its initialisation and the adapter folder
format that ``peft.PeftModel.from_pretrained`` loads, so megaforge does not write its own.

A targeted ``nn.Linear`` with frozen weight W [out, in] becomes, with r = ``model.lora.rank``,
s = ``model.lora.alpha`` / r,

    y = x W^T + s * dropout(x) A^T B^T        A [r, in] (Kaiming-uniform init), B [out, r] (zeros)

(PEFT's ``LoraLayer``; the adapter names ``default``). The merged weight the engines get is

    W' = W + s * B A                          [out, in], computed in float32, cast to W's dtype

which equals the adapted forward exactly when dropout is 0 (up to the float rounding of the
sum). :class:`LoraPolicy` keeps the PEFT wrapper next to the HF CausalLM that it changed in place:
the trainer keeps training ``lm`` (the HF CausalLM, whose targeted linears are now PEFT's layers).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from megaforge.configtree import ConfigError
from megaforge.sync.adapters import merge_lora

#: PEFT's name of the one adapter megaforge trains
ADAPTER = "default"


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of ``model``'s ``nn.Linear`` modules, in module order (``q_proj``, ...)."""
    out: list[str] = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, torch.nn.Linear) and leaf not in out:
            out.append(leaf)
    return out


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """ConfigError naming ``model.lora.target_modules`` and listing the linear module names unless every
    target matches at least one ``nn.Linear`` of ``model`` (by its full dotted name or its last parts:
    PEFT's rule, ``name == t or name.endswith("." + t)``)."""
    if not targets:
        raise ConfigError(f"model.lora.target_modules: empty; modules: {', '.join(linear_names(model))}")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            raise ConfigError(f"model.lora.target_modules: {t!r} matches no module; modules: "
                              f"{', '.join(linear_names(model))}")


def peft_config(lcfg, base_path: str = ""):
    """PEFT's ``LoraConfig`` of ``model.lora`` (what both backends' adapter folders declare)."""
    try:
        import peft  # lazy: only LoRA runs need it
    except ImportError as e:
        raise ConfigError(f"model.lora needs peft (pip install 'megaforge[lora]', tested peft==0.21.2): {e}") from e
    pcfg = peft.LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                           target_modules=list(lcfg.target_modules), bias="none", task_type="CAUSAL_LM")
    if base_path:
        pcfg.base_model_name_or_path = base_path
    return pcfg


def write_adapter_folder(path: str, tensors: dict[str, torch.Tensor], lcfg, base_path: str = "") -> None:
    """A PEFT adapter folder from full adapter tensors named as PEFT saves them
    (``base_model.model.<HF module>.lora_A.weight`` [r, in], ``...lora_B.weight`` [out, r]):
    ``adapter_config.json`` (PEFT's own writer) and ``adapter_model.safetensors`` (the format
    ``PeftModel.save_pretrained`` writes). For backends that hold the adapters outside PEFT (megatron)."""
    from safetensors.torch import save_file

    peft_config(lcfg, base_path).save_pretrained(path)
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})


class LoraPolicy:
    """The policy ``lm`` with PEFT LoRA adapters injected in place (base parameters frozen:
    ``requires_grad`` False; the adapters' A and B the only trainable parameters)."""

    def __init__(self, lm: torch.nn.Module, lcfg, base_path: str = ""):
        try:
            import peft  # lazy: only LoRA runs need it
        except ImportError as e:
            raise ConfigError(f"model.lora needs peft (pip install 'megaforge[lora]', tested peft==0.21.2): {e}") from e

        check_targets(lm, list(lcfg.target_modules))
        # the A init draws from the global RNG: seeded by the run's seed (Run sets torch.manual_seed)
        self.peft = peft.get_peft_model(lm, peft_config(lcfg))
        if base_path:
            self.peft.peft_config[ADAPTER].base_model_name_or_path = base_path
        self.lm = lm  # the same module object, adapted in place
        self.scale = lcfg.alpha / lcfg.rank

    # ------------------------------------------------------------------------------ parameters
    def adapter_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name in ``lm``, parameter) of the trainable adapter tensors, in module order."""
        return [(n, p) for n, p in self.lm.named_parameters() if p.requires_grad]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapters' tensors by their names in ``lm`` (what a checkpoint holds of the policy)."""
        return {n: p.detach() for n, p in self.adapter_parameters()}

    def load_adapter_state(self, state: dict[str, torch.Tensor], where: str) -> None:
        """Copy ``state`` (:meth:`adapter_state`'s form) into the adapters; a name or shape mismatch
        is a ValueError naming ``where`` (e.g. a checkpoint of another rank or target list)."""
        own = dict(self.adapter_parameters())
        if set(own) != set(state):
            missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise ValueError(f"{where}: the saved LoRA adapters do not match model.lora (missing {missing[:3]}, "
                             f"unexpected {extra[:3]})")
        with torch.no_grad():
            for n, p in own.items():
                if p.shape != state[n].shape:
                    raise ValueError(f"{where}: adapter {n} has shape {tuple(state[n].shape)}, model.lora makes "
                                     f"{tuple(p.shape)} (another model.lora.rank?)")
                p.copy_(state[n])

    def base_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, frozen tensor) of the base weights, as the un-adapted model names them."""
        for name, t in self.lm.state_dict().items():
            if ".lora_" not in name:
                yield name.replace(".base_layer.", "."), t

    def fresh(self) -> bool:
        """True while every B is zero: the adapted policy equals the base."""
        return all(not bool(p.detach().any()) for n, p in self.adapter_parameters() if ".lora_B." in n)

    # ------------------------------------------------------------------------------ merged
    def _lora_layers(self) -> dict[str, torch.nn.Module]:
        from peft.tuners.lora import LoraLayer

        return {n: m for n, m in self.lm.named_modules() if isinstance(m, LoraLayer)}

    def merged_tensor(self, layer, weight: torch.Tensor) -> torch.Tensor:
        """W + s * B A of one adapted linear ``layer`` (W = ``weight``), float32 sum cast to W's dtype."""
        return merge_lora(weight, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight,
                          float(layer.scaling[ADAPTER]))

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(HF module name, A [r, in], B [out, r]) of every adapted linear."""
        for mod, layer in self._lora_layers().items():
            yield mod, layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()

    def merged_state(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for ``names`` (the un-adapted model's state names): the base tensor, or the
        merged W + s B A for an adapted linear's weight, computed one tensor at a time."""
        sd = self.lm.state_dict()
        layers = self._lora_layers()
        for name in names:
            mod = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and mod in layers:
                yield name, self.merged_tensor(layers[mod], sd[f"{mod}.base_layer.weight"])
            else:
                yield name, sd[name.replace(f"{mod}.", f"{mod}.base_layer.", 1) if mod in layers else name]

    # ------------------------------------------------------------------------------ reference
    @contextlib.contextmanager
    def adapters(self, state: Optional[dict[str, torch.Tensor]]):
        """The adapters off (``state`` None: the base model, no second copy of it) or temporarily set to
        ``state`` (the reference's frozen adapters after a LoRA warm start), restored after."""
        if state is None:
            with self.peft.disable_adapter():
                yield
            return
        keep = {n: t.clone() for n, t in self.adapter_state().items()}
        self.load_adapter_state(state, "reference adapters")
        try:
            yield
        finally:
            self.load_adapter_state(keep, "policy adapters")

    # ------------------------------------------------------------------------------ export
    def save_adapter(self, path: str) -> None:
        """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
        ``peft.PeftModel.from_pretrained(base, path)`` loads."""
        self.peft.save_pretrained(path, safe_serialization=True)
