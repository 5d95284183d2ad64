"""megaforge's own math reward (megaforge.rewards.verifiers.MathReward: the last ``\\boxed{}`` of the
response against the reference, numbers compared numerically, else math-verify) behind each peer's
reward signature, so every system is rewarded by the same function.

* verl 0.9.1: ``reward.custom_reward_function.path=tools/peers/peer_reward.py`` and
  ``reward.custom_reward_function.name=compute_score``; its reward manager (``naive``) calls
  ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **kw)`` with the response
  decoded without special tokens, and a float result is the score (and the ``acc`` of its validation).
* TRL 1.16.0: ``reward_funcs=[trl_math_reward]``; GRPOTrainer calls it with ``prompts``, ``completions``
  (conversational: ``[[{"role": "assistant", "content": ...}]]``), ``completion_ids`` and every dataset
  column as a keyword (``answer`` here), and wants one float per completion.
* slime (THUDM/slime 624b824a8): ``--custom-rm-path peer_reward.slime_math_reward`` (``tools/peers`` on
  PYTHONPATH); its rollout manager awaits ``slime_math_reward(args, sample)`` per sample, with the decoded
  ``sample.response`` and the row's ``sample.label`` (``--label-key answer``).

megaforge runs this reward in worker processes with a time limit per call (``rewards.timeout_s``); the peers
call it in their own threads without one (a GSM8K answer is graded in microseconds; only math-verify on a
symbolic answer is slower, and :func:`megaforge.rewards.verifiers.answers_equal` sizes answers first).
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # verl loads this file by path, in its reward workers
    sys.path.insert(0, _ROOT)

from megaforge.rewards.verifiers import MathReward  # noqa: E402

_REWARD = MathReward()


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's custom reward signature: 1.0 when ``solution_str``'s final answer equals ``ground_truth``."""
    return float(_REWARD("", solution_str, ground_truth))


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: the assistant turn(s)
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def trl_math_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward function signature: one float per completion, against the row's ``answer``."""
    return [float(_REWARD("", _text(c), a)) for c, a in zip(completions, answer)]


async def slime_math_reward(args, sample, **kwargs) -> float:
    """slime's custom reward signature (``slime.rollout.rm_hub.async_rm``): one sample's response against its label."""
    return float(_REWARD("", sample.response, sample.label))
