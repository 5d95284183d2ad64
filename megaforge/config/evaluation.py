"""Config section of held-out evaluation during RL (``eval:``)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from megaforge.config.rewards import reward_label
from megaforge.configtree import bounded


@dataclass
class EvalSetConfig:
    """One held-out prompt set. Its prompts are built like the training prompts (``data.system_prompt``,
    ``data.apply_chat_template``, ``data.max_prompt_len``) and scored by ``rewards.functions``."""

    name: str = ""
    """Name of the set: its metrics are ``eval/<name>/...`` (letters, digits, ``_``, ``-``, ``.``)."""
    path: str = ""
    """A .jsonl / .parquet file or folder, or a `datasets` dataset (local or hub); empty: hold out
    ``holdout`` of data.path's distinct prompts (never trained on)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """How to read ``path``; ``auto`` decides from the path."""
    split: str = "test"
    """Split of a `datasets` dataset."""
    subset: str = ""
    """Configuration (subset) of a `datasets` hub dataset, e.g. ``main`` for openai/gsm8k."""
    input_key: str = ""
    """Row key of the prompt (empty: data.input_key)."""
    label_key: str = ""
    """Row key of the reference answer (empty: data.label_key)."""
    holdout: float = 0.0
    """With ``path`` empty: the fraction (0 < f < 1) of data.path's distinct prompts held out of training
    (chosen with the run's seed; every row with a held-out prompt leaves the RL and SFT data)."""
    max_rows: int = 0
    """Evaluate the first N prompts of the set only (0: all)."""


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts through the rollout engine (megaforge.eval): greedy pass@1 and
    sampled pass@k, the reward's components and the response length per set, logged as
    ``eval/<set>/...`` in the step's metrics row."""

    sets: list[EvalSetConfig] = field(default_factory=list)
    """Held-out sets (a file, a `datasets` split, or ``holdout`` of data.path); empty: no evaluation."""
    interval: int = 0
    """Evaluate after every N RL steps and after the last one (0: only before training, see below)."""
    before_train: bool = False
    """Evaluate the starting policy (after any SFT warm start), logged as step 0."""
    greedy: bool = True
    """Greedy pass@1: one temperature-0 response per prompt."""
    n_samples: int = 0
    """Sampled responses per prompt for pass@k (0: none)."""
    pass_k: list[int] = field(default_factory=list)
    """k of the sampled pass@k (each 1 <= k <= eval.n_samples); empty: 1 and eval.n_samples."""
    temperature: Optional[float] = bounded(None, gt=0)
    """Temperature of the sampled responses (null: grpo.temperature); top_p / top_k are rollout's."""
    max_new_tokens: int = 0
    """Response length limit (0: rollout.max_new_tokens)."""
    correct_reward: str = ""
    """The reward function (a name in rewards.functions) that decides correctness for pass@k; empty:
    the first one."""
    correct_threshold: float = 1.0
    """A response is correct when that reward's unweighted value is >= this."""
    check_disjoint: bool = True
    """Refuse a set whose prompt is also a training prompt (data.path, and sft.data when the warm start
    runs), naming the set and the row; a streaming training set is read through once for it."""
    write_samples: bool = True
    """Write every evaluated response to ``<run dir>/eval/<set>/step_NNNNNN.jsonl``."""

    def validate_with(self, cfg, need) -> None:
        """Checks that need the rest of the config (called by Config.validate)."""
        names = [s.name for s in self.sets]
        for i, s in enumerate(self.sets):
            key = f"eval.sets[{i}]"
            need(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", s.name)), f"{key}.name",
                 f"must be a non-empty name of letters, digits, '_', '-', '.' (got {s.name!r})")
            need(names.count(s.name) == 1, f"{key}.name", f"{s.name!r} names more than one set")
            need(s.max_rows >= 0, f"{key}.max_rows", "must be >= 0")
            if s.path:
                need(s.holdout == 0.0, f"{key}.holdout", "holds out of data.path: leave eval.sets[].path empty")
            else:
                need(0.0 < s.holdout < 1.0, f"{key}.holdout",
                     "set a fraction in (0, 1) of data.path to hold out, or eval.sets[].path")
                need(not cfg.data.streaming, f"{key}.holdout", "needs map-style data (data.streaming false)")
        need(sum(not s.path for s in self.sets) <= 1, "eval.sets", "at most one set may hold out of data.path")
        need(self.interval >= 0, "eval.interval", "must be >= 0")
        need(self.n_samples >= 0, "eval.n_samples", "must be >= 0")
        need(self.greedy or self.n_samples > 0 or not self.sets, "eval.greedy",
             "evaluation needs greedy responses or eval.n_samples > 0")
        for k in self.pass_k:
            need(1 <= k <= self.n_samples, "eval.pass_k", f"{k} is not in [1, eval.n_samples={self.n_samples}]")
        need(self.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0")
        need(not self.sets or self.interval > 0 or self.before_train, "eval.sets",
             "are never evaluated: set eval.interval and/or eval.before_train")
        need(not self.correct_reward or correct_reward_label(self, cfg.rewards) is not None, "eval.correct_reward",
             f"{self.correct_reward!r} is not in rewards.functions (names "
             f"{', '.join(f.name for f in cfg.rewards.functions)}; labels "
             f"{', '.join(reward_label(f) for f in cfg.rewards.functions)})")

    @property
    def ks(self) -> list[int]:
        """The k values of sampled pass@k."""
        return list(self.pass_k) if self.pass_k else sorted({1, self.n_samples}) if self.n_samples else []


def correct_reward_label(eval_cfg, rewards) -> Optional[str]:
    """The label (its key in a sample's reward components) of the reward that decides correctness:
    ``eval.correct_reward`` (of the ``eval`` section ``eval_cfg``) matched against each of
    ``rewards.functions``' name, the name's last part or its label; empty: the first function's. None
    when nothing matches."""
    want = eval_cfg.correct_reward
    for f in rewards.functions:
        if not want or want in (f.name, f.name.rsplit(":", 1)[-1], reward_label(f)):
            return reward_label(f)
    return None
