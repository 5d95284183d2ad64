"""On-policy distillation: the student samples, a frozen teacher scores every sampled token, and the
per-token reverse KL between them is a dense advantage (``algo.advantage: distill``).

Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD, ICLR 2024, arXiv:2306.13649): train the student on its own samples
(on-policy, their lambda = 1) against the teacher's token distribution, the reverse KL
KL(pi_student || pi_teacher) being one of their divergences; and Thinking Machines Lab, "On-Policy
Distillation" (Lu et al., Connectionism, Oct. 2025): the single-sample per-token reverse KL of the
sampled token used as the per-token advantage of a policy-gradient loss, with discount 0.

For row i, response token y_t sampled by the student from its context c_t (the prompt and y_<t):

    k_t   = log pi_student(y_t | c_t) - log pi_teacher(y_t | c_t)
            (E_{y_t ~ pi_student}[k_t] = KL(pi_student(.|c_t) || pi_teacher(.|c_t)), the reverse KL at t)
    A_t   = -kl_coef * k_t + task_coef * A^task_i          (0 where loss_mask is 0)

with log pi_student the trainer's log-probs of the policy that sampled (pi_old, computed before the
update by the same kernel as the teacher's: a teacher equal to the student gives k_t = 0 exactly) and
A^task_i the task reward's sequence advantage of row i by ``teacher.task_advantage`` (grpo, dr_grpo,
rloo; only when task_coef > 0). Tokens the teacher finds likelier than the student does get a
positive advantage, tokens it finds unlikely a negative one; the policy loss (``algo.loss``) then
turns A_t into the update like any other advantage. Both log-probs are at the sampling temperature
(``grpo.temperature``, the trainer's for every model). Shapes: logprobs, teacher_logprobs,
loss_mask [n, T] (the rows held: the whole batch, or one data-parallel share); rewards, group ids [B].
"""
from __future__ import annotations

import torch

from megaforge.algorithms.core import ADVANTAGES, AdvantageInputs
from megaforge.algorithms.params import ObjectiveParams

#: task-reward estimators that can be combined with the KL term (sequence-level, share-capable)
TASK_ADVANTAGES = ("grpo", "dr_grpo", "rloo")


def reverse_kl_tokens(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """k_t = (log pi_student(y_t) - log pi_teacher(y_t)) * loss_mask_t, [n, T] float32."""
    mask = loss_mask.to(torch.float32)
    return (logprobs.to(torch.float32) - teacher_logprobs.to(torch.float32)) * mask


@ADVANTAGES.register("distill", shares=True)
def distill_advantage(inp: AdvantageInputs, p: ObjectiveParams) -> torch.Tensor:
    """A_t = -p.distill_kl_coef * k_t + p.distill_task_coef * A^task (module docstring), [n, T]."""
    if inp.logprobs is None or inp.teacher_logprobs is None:
        raise ValueError("algo.advantage distill: the batch lacks the student's (pi_old) or the teacher's log-probs "
                         "of the sampled tokens (AdvantageInputs.logprobs / teacher_logprobs)")
    adv = -p.distill_kl_coef * reverse_kl_tokens(inp.logprobs, inp.teacher_logprobs, inp.loss_mask)
    if p.distill_task_coef > 0:
        if p.distill_task_advantage not in TASK_ADVANTAGES:
            raise ValueError(f"teacher.task_advantage {p.distill_task_advantage!r}: one of {', '.join(TASK_ADVANTAGES)}")
        task = ADVANTAGES.get(p.distill_task_advantage)(inp, p)
        adv = adv + p.distill_task_coef * task.to(adv.dtype)
    return adv.to(inp.loss_mask.dtype) * inp.loss_mask
