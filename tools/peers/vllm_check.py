#!/usr/bin/env python
"""The GPU machine's check of the vLLM kit (tools/peers/prepare_vllm.sh, h200_peers.sh vllm_kit), before TRL's
colocate run: each import TRL 1.16.0's ``use_vllm=True, vllm_mode="colocate"`` path makes, and the compiled parts
it loads, one JSON line per check (``{"check", "ok", "detail"}``), then a summary line; exit 1 if one failed.

    PYTHONPATH=$PWD:/tmp/trlsite:/tmp/vllmsite python3 tools/peers/vllm_check.py

Checks: vLLM's version inside TRL's accepted range (trl.import_utils.is_vllm_available, no warning); the
platform vLLM resolves (CudaPlatform, compute capability); ``vllm._C_stable_libtorch`` (vLLM's ops against the
machine's torch); FA3 (``vllm.vllm_flash_attn``: FA2 is left out of the kit) and the version vLLM picks for
head dim 64 (Qwen2.5-0.5B's; must be 3); ``vllm.cumem_allocator`` (TRL's sleep mode); ``from vllm import LLM,
SamplingParams`` and TRL's ``trl.generation.vllm_generation``; where each third-party module came from.
On a CPU machine the CUDA checks fail (no libcuda.so.1, no device): the import checks still run.
"""
from __future__ import annotations

import importlib
import json
import sys
import warnings

RESULTS: list[dict] = []


def check(name: str, fn) -> object:
    try:
        detail = fn()
        RESULTS.append({"check": name, "ok": True, "detail": detail})
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the next check runs
        detail = None
        RESULTS.append({"check": name, "ok": False, "detail": f"{type(e).__name__}: {str(e)[:400]}"})
    print(json.dumps(RESULTS[-1]), flush=True)
    return detail


def versions() -> dict:
    import torch
    import transformers
    import vllm
    return {"vllm": vllm.__version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def trl_accepts() -> str:
    from trl.import_utils import is_vllm_available
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TRL warns when the version is outside 0.22.0-0.31.0
        assert is_vllm_available(), "trl.import_utils.is_vllm_available() is False"
    import trl
    return f"trl {trl.__version__} accepts it"


def platform() -> dict:
    from vllm.platforms import current_platform
    cap = current_platform.get_device_capability()
    assert type(current_platform).__name__ == "CudaPlatform", f"platform {type(current_platform).__name__}"
    return {"platform": type(current_platform).__name__, "capability": cap.as_version_str() if cap else None}


def fa3() -> dict:
    from vllm.vllm_flash_attn import flash_attn_interface as fai
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    version = get_flash_attn_version(head_size=64)
    assert fai.FA3_AVAILABLE, fai.FA3_UNAVAILABLE_REASON
    assert version == 3, f"vLLM picks FA{version} for head dim 64"
    return {"fa3": True, "fa2": fai.FA2_AVAILABLE, "version_for_head_dim_64": version}


def import_all(mods: list[str]) -> int:
    """Imports every module, then raises with each one that failed (not only the first)."""
    errors = {}
    for m in mods:
        try:
            importlib.import_module(m)
        except BaseException as e:  # noqa: BLE001
            errors[m] = f"{type(e).__name__}: {str(e)[:200]}"
    if errors:
        raise ImportError(json.dumps(errors))
    return len(mods)


def origins() -> dict:
    """Where each top-level third-party module imported so far came from (the kit's site or the machine's)."""
    import os
    out: dict[str, list[str]] = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if "." in name or not f or name in sys.stdlib_module_names:
            continue
        parts = os.path.abspath(f).split(os.sep)
        site = os.sep.join(parts[:-2] if parts[-1] == "__init__.py" else parts[:-1])
        out.setdefault(site, []).append(name)
    return {k: sorted(v) for k, v in sorted(out.items())}


def main() -> int:
    check("versions", versions)
    check("trl_accepts_vllm", trl_accepts)
    check("vllm_ops", lambda: importlib.import_module("vllm._C_stable_libtorch").__file__)
    check("platform", platform)
    check("flash_attn_3", fa3)
    check("sleep_mode_allocator", lambda: importlib.import_module("vllm.cumem_allocator").__file__)
    check("llm_import", lambda: bool(importlib.import_module("vllm.entrypoints.llm").LLM)
          and bool(importlib.import_module("vllm").SamplingParams))
    mods = ["vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
            "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.qwen2",
            "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler", "vllm.compilation.backends",
            "vllm.device_allocator.cumem", "trl.generation.vllm_generation"]
    check("engine_modules", lambda: import_all(mods))
    check("module_origins", origins)
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(json.dumps({"vllm_check": "ok" if not failed else "failed", "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
