"""Kahneman-Tversky optimisation on unpaired completions, as TRL 1.16's ``KTOTrainer``.

KTO (Ethayarajh et al., 2024): each completion is desirable or not, and its loss reads the
log-ratio of the policy to the reference summed over the completion, against the batch's KL
estimate (:func:`kl_estimate`) for ``loss_type="kto"``, or against 0 for
``apo_zero_unpaired`` (the unpaired variant of Eq. (7) of the APO paper).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

LOSS_TYPES = ("kto", "apo_zero_unpaired")
# Per row, summed over rows by the caller: the KL estimate each row carries, the rewards and
# log-probs of the desirable rows and of the undesirable ones (0 for the others), and whether
# the row is desirable, or not.
STATS = (
    "kl",
    "rewards/chosen_sum",
    "rewards/rejected_sum",
    "logps/chosen_sum",
    "logps/rejected_sum",
    "count/chosen",
    "count/rejected",
)


class RowLosses(NamedTuple):
    """Each row's weighted loss, (rows,), and its :data:`STATS`, (rows, 7)."""

    losses: torch.Tensor
    stats: torch.Tensor


def kl_estimate(
    policy_kl_logps: torch.Tensor,
    reference_kl_logps: torch.Tensor,
    across_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """TRL's KL estimate from the summed log-probs of the KL completions (each row's prompt
    with another row's completion) under the policy and the reference: their log-ratios'
    mean over the micro-batch, detached, averaged over the processes by ``across_processes``
    (given where there are several), clamped at 0."""
    kl = (policy_kl_logps - reference_kl_logps).mean().detach()
    if across_processes is not None:
        kl = across_processes(kl)
    return kl.clamp(min=0)


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> RowLosses:
    """Per row: the weighted loss, from the summed log-probs of its completion under the
    policy and the reference, its label (``desirable``, bool) and the batch's KL (a 0-d
    tensor, unused by ``apo_zero_unpaired``); and its :data:`STATS`."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose {', '.join(LOSS_TYPES)}")
    ratios = policy_logps - reference_logps
    if loss_type == "kto":  # Eq. (7) of the KTO paper, as TRL
        losses = torch.where(
            desirable,
            1 - torch.sigmoid(beta * (ratios - kl)),
            1 - torch.sigmoid(beta * (kl - ratios)),
        )
    else:  # apo_zero_unpaired: the unpaired variant of Eq. (7) of the APO paper
        losses = torch.where(
            desirable,
            1 - torch.sigmoid(beta * ratios),
            torch.sigmoid(beta * ratios),
        )
    weights = torch.where(
        desirable,
        torch.full_like(losses, desirable_weight),
        torch.full_like(losses, undesirable_weight),
    )
    rewards = (beta * ratios).detach()
    chosen, rejected = desirable.float(), (~desirable).float()
    logps = policy_logps.detach()
    stats = torch.stack(
        [
            kl.expand_as(rewards).float(),
            rewards * chosen,
            rewards * rejected,
            logps * chosen,
            logps * rejected,
            chosen,
            rejected,
        ],
        dim=1,
    )
    return RowLosses(losses * weights, stats)
