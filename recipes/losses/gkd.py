"""Generalized knowledge distillation's divergence, as TRL 1.16's ``GKDTrainer`` computes it
(``trl/experimental/gkd/gkd_trainer.py``, ``generalized_jsd_loss``; Agarwal et al., "On-Policy
Distillation of Language Models"): per position, the generalized Jensen-Shannon divergence
between the student's and the teacher's next-token distributions, at temperature 1. ``beta``
0 is KL(teacher || student), 1 is KL(student || teacher), between them the JSD against the
beta-mixture of the two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from recipes.losses.linear_ce import HeadInput, per_chunk


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher: torch.Tensor,
    beta: float,
    teacher_is_logps: bool = False,
) -> torch.Tensor:
    """Each position's generalized JSD (summed over the vocabulary), as TRL's
    ``GKDTrainer.generalized_jsd_loss`` computes it elementwise (``F.kl_div`` with log targets;
    temperature 1); ``teacher``: its logits, or its log-probabilities (precomputed)."""
    student = F.log_softmax(student_logits.float(), dim=-1)
    teacher = teacher.float() if teacher_is_logps else F.log_softmax(teacher.float(), dim=-1)
    if beta == 0:
        jsd = F.kl_div(student, teacher, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher, student, reduction="none", log_target=True)
    else:
        # TRL makes beta a device tensor; a Python float gives the same sums without the copy.
        mixture = torch.logsumexp(
            torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0
        )
        jsd = beta * F.kl_div(mixture, teacher, reduction="none", log_target=True) + (
            1 - beta
        ) * F.kl_div(mixture, student, reduction="none", log_target=True)
    return jsd.sum(-1)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    teacher_is_logps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed generalized JSD over its labelled positions, and their count: from
    the (rows, length, vocabulary) student logits, the labelled positions' ``mask`` (rows,
    length) and the teacher's logits there (every position; the unlabelled ones are zeroed,
    which needs no host sync to find the labelled ones), or (``teacher_is_logps``) its
    log-probabilities at the labelled positions only, (labelled, vocabulary)."""
    if teacher_is_logps:
        per_token = student_logits.new_zeros(mask.shape, dtype=torch.float32)
        per_token[mask] = generalized_jsd(student_logits[mask], teacher, beta, True)
    else:
        per_token = generalized_jsd(student_logits, teacher, beta) * mask
    return per_token.sum(1), mask.sum(1)


def chunked_distillation_loss(
    student: HeadInput,
    teacher: HeadInput | torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    teacher_is_logps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`distillation_loss` from the student's hidden states (and the teacher's, or its
    log-probabilities at the labelled positions), the labelled positions' logits of both
    computed a chunk at a time (:func:`recipes.losses.linear_ce.per_chunk`): neither model's
    (rows, length, vocabulary) logits exist whole. The teacher's ``project`` runs without
    autograd."""
    index = mask.reshape(-1).nonzero().squeeze(1)
    other = teacher if teacher_is_logps else teacher.rows(index)

    def chunk(logits: torch.Tensor, theirs: torch.Tensor) -> tuple[torch.Tensor]:
        if not teacher_is_logps:
            with torch.no_grad():
                theirs = teacher.project(theirs)
        return (generalized_jsd(logits, theirs, beta, teacher_is_logps),)

    (per_token,) = per_chunk(chunk, student, student.rows(index), other)
    sums = per_token.new_zeros(len(mask)).index_add(0, index // mask.shape[1], per_token)
    return sums, mask.sum(1)
