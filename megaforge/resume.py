"""What ``--resume`` checks in the run folder before it loads anything (megaforge.loop.Run, main rank).

The configuration: the run folder's ``config.yaml`` (the configuration the run was started, or last
resumed, with) is compared key by key with the new one. Every changed key is printed as
``key: old -> new``. A change in :data:`HARMLESS` (how long, how often it evaluates / checkpoints /
logs, timeouts, where servers listen) is only printed; any other change (the seed, the data, the model,
grpo.n_samples, the learning rate, ...: what makes the resumed run differ from the run continued
unchanged) is refused, naming the keys, unless ``resume_allow_changes`` names each of them (or a section
above it). A key only one side has (a config.yaml of another megaforge version) is printed, not refused.
When the new configuration is accepted with changes, the old ``config.yaml`` is kept as
``logs/config.<n>.yaml`` before the new one is written. An allowed change takes effect from the resumed
step on (learning-rate keys through the checkpoint's schedule: megaforge.loop.Run); what the checkpoint
holds (weights, optimizer state, data position) is loaded whatever ``model.path`` or ``data`` now say.

The metrics files: see :func:`megaforge.metrics.set_aside_bad_rows`.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import yaml


#: keys (or sections, ending in ".") whose change keeps the resumed run's steps those of the run continued
#: unchanged: its length, evaluation (except which sets: a holdout set changes the training data),
#: checkpoint / export / metric schedules, timeouts, restarts, where engine servers listen and the weight
#: sync's bucketing and checks, the offload (exact copies), the job's resources
HARMLESS = ("output_dir", "run_name", "max_steps", "export_hf_every",
            "metrics.", "eval.", "checkpoint.", "launch.", "slurm.", "memory.", "sync.bucket_mb",
            "sync.check_equal", "rollout.startup_timeout_s", "rollout.request_timeout_s",
            "rollout.health_timeout_s", "rollout.max_restarts", "rollout.snapshot_dir", "rollout.engine_python",
            "rollout.engine_env", "rollout.host", "rollout.api_key", "rollout.weight_roots", "rewards.timeout_s",
            "rewards.start_timeout_s", "rewards.workers")
#: exceptions inside a harmless section
NOT_HARMLESS = ("eval.sets",)
#: the flags of the resume itself: not compared
OWN = ("resume", "resume_allow_changes")
ABSENT = "(not set)"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{dotted key: value}`` (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _under(key: str, names) -> bool:
    return any(key == n.rstrip(".") or key.startswith(n if n.endswith(".") else n + ".") for n in names)


def harmless(key: str) -> bool:
    return _under(key, HARMLESS) and not _under(key, NOT_HARMLESS)


def allowed_changes(spec: str) -> list[str]:
    """``resume_allow_changes`` (``"seed,trainer.lr"``) as a list of keys / sections."""
    return [k.strip() for k in spec.split(",") if k.strip()]


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """``[(dotted key, old value, new value)]`` of the keys whose values differ (ABSENT: one side lacks it)."""
    a, b = ({k: v for k, v in flatten(t).items() if k not in OWN} for t in (old, new))
    return [(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in dict.fromkeys([*a, *b]) if a.get(k, ABSENT) != b.get(k, ABSENT)]


def _short(v: Any) -> str:
    s = repr(v) if v is not ABSENT else v
    return s if len(s) <= 120 else s[:117] + "..."


def check_config(path: str, tree: dict, allow_changes, say) -> Optional[str]:
    """Compare the saved configuration at ``path`` with ``tree`` (the new configuration as a nested dict:
    ``configtree.to_dict``; see the module doc), allowing the changes ``allow_changes``
    (``resume_allow_changes``); ``say`` prints each change. Returns the refusal (one line naming the keys
    and the way to allow them), else None; on None the caller writes the new configuration to ``path``
    (the old file already kept when anything changed)."""
    if not os.path.exists(path):
        say(f"--resume: {path} does not exist; nothing to compare the configuration with")
        return None
    try:
        with open(path, "rb") as f:
            old = yaml.safe_load(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return (f"--resume: {path} (the configuration of the run being continued) is unreadable "
                f"({str(e).splitlines()[0]}): move it aside to resume without the comparison")
    if not isinstance(old, dict):
        return f"--resume: {path} is not a mapping of config keys: move it aside to resume without the comparison"
    changes = config_changes(old, tree)
    allow = allowed_changes(allow_changes)
    refused = []
    for key, was, now in changes:
        if was is ABSENT or now is ABSENT:
            kind = "a key of another megaforge version"
        elif harmless(key):
            kind = "does not change the steps"
        elif _under(key, allow):
            kind = "allowed by resume_allow_changes"
        else:
            kind = "REFUSED: changes the run's steps"
            refused.append(key)
        say(f"--resume: config change {key}: {_short(was)} -> {_short(now)} ({kind})")
    if refused:
        return (f"--resume: {', '.join(refused)} changed since the run's {path}; the resumed run would not be "
                f"the continuation of the run it resumes (its sample stream, shapes or updates change). "
                f"Resume with the old values, or pass --resume_allow_changes {','.join(refused)} to continue "
                f"with the new ones (nothing was changed)")
    if changes:
        logs = os.path.join(os.path.dirname(path), "logs")
        os.makedirs(logs, exist_ok=True)
        n = 1
        while os.path.exists(os.path.join(logs, f"config.{n}.yaml")):
            n += 1
        shutil.copy2(path, os.path.join(logs, f"config.{n}.yaml"))
        say(f"--resume: the previous configuration is kept as {os.path.join(logs, f'config.{n}.yaml')}")
    return None
