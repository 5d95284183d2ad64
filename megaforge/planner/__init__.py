"""The dry-run planner: ``launchers/grpo.py --config X.yaml --dry_run`` (and ``launchers/sft.py``).

It resolves the config, reads the model's HF ``config.json`` (``--model_config``, ``model.config``,
a local ``model.path``, or the local HF cache: never the network, never weights), checks that the
parallel layout divides the model and the GPUs, and prints the placement (which trainer rank and
which engine on which GPU of which node) and a per-GPU memory estimate of every phase against the
GPU's memory, with a verdict and the knobs that make a phase fit.

The planner reads a :class:`megaforge.specs.PlanInput` (the sections it needs, built by
:meth:`megaforge.build.RunBuilder.plan_input`), not the whole configuration.

Parts: :mod:`.shapes` (model shapes, parameter counts), :mod:`.layout` (checks, placement),
:mod:`.memory` (the per-item formulas), :mod:`.phases` (phases, verdicts, knobs),
:mod:`.report` (text, JSON, exit status).

Launcher flags (not config keys): ``--dry_run``, ``--dry_run_json FILE``, ``--model_config PATH``,
``--teacher_config PATH`` (the distillation teacher's config.json or its folder, where ``teacher.path`` is
not an HF folder on this machine),
``--nodes N`` (default 1), ``--gpus_per_node G`` (default: one trainer replica), ``--gpu NAME``
(H100, H200, A100-80GB, ...) or ``--gpu_memory_gib X`` (default 80), ``--reserve_gib X`` (per
trainer process, default 2).
"""
from megaforge.planner.report import FLAGS, FlagError, dry_run, format_plan, make_plan, split_argv

__all__ = ["FLAGS", "FlagError", "dry_run", "format_plan", "make_plan", "split_argv"]
