"""Config section of on-policy distillation (``teacher:``): the frozen teacher that scores the
student's sampled tokens, and the weights of its signal against the task reward
(``algo.advantage: distill``; formula in :mod:`megaforge.algorithms.distill`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megaforge.configtree import bounded


@dataclass
class TeacherConfig:
    """The teacher of ``algo.advantage: distill``: loaded once at start-up on the trainer's device
    (at the policy's TP / PP layout with the megatron backend; or served by an engine:
    ``teacher.served_by``), frozen, never checkpointed (it is
    re-read from ``teacher.path`` on resume). Its tokenizer must equal the student's (same
    token -> id map) and its vocabulary size the student's, or the run refuses to start."""

    path: str = ""
    """The teacher's weights: a Hugging Face model folder (config.json, safetensors, tokenizer), a
    megaforge run folder (its newest complete checkpoint; without one, its newest ``hf/`` export) or
    one checkpoint folder of a run (``<run>/checkpoints/step_N``: torch-backend checkpoints are read
    directly, megatron ones must first be exported with tools/convert_megatron_to_hf.py). Empty: no
    teacher (every algo.advantage other than distill)."""
    served_by: Literal["trainer", "engine"] = "trainer"
    """Where the teacher scores the sampled tokens. trainer: a frozen copy on the trainer's device (like
    the reference model; every trainer rank scores its share). engine: an inference engine returns
    the prompt log-probs of the given token ids (megaforge.trainer.served_teacher): with
    ``teacher.url`` empty an embedded engine holding teacher.path on ``rollout.device`` in each
    trainer process; with ``teacher.url`` set the SGLang server there (``/generate`` with
    ``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len`` 0). Both take the log-probs at
    ``grpo.temperature``, as the trainer-side teacher: the embedded engine divides the logits by it,
    SGLang's prompt log-probs are of the raw logits (temperature 1), so with a URL grpo.temperature
    must be 1.0."""
    url: str = ""
    """With ``served_by: engine``: the base URL of an SGLang server (>= 0.5.16) already serving
    teacher.path's weights (e.g. ``http://10.0.0.5:30000``; started by you, e.g. ``python -m
    sglang.launch_server --model-path <teacher.path> ...``); empty: the embedded engine. teacher.path
    stays required: the tokenizer check reads its tokenizer."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The teacher's parameter and compute dtype; auto: model.dtype."""
    kl_coef: float = bounded(1.0, ge=0)
    """Weight of the per-token reverse KL: advantage_t = -kl_coef * (log pi_student(y_t) - log
    pi_teacher(y_t)) + task_coef * task advantage."""
    task_coef: float = bounded(0.0, ge=0)
    """Weight of the task reward's advantage (``teacher.task_advantage`` of the rewards) added to
    the KL term; 0: pure distillation (the rewards are then only logged)."""
    task_advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """The estimator of the task-reward advantage combined with the KL term when task_coef > 0."""
