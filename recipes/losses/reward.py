"""A reward model's loss on preference pairs, as TRL 1.16's ``RewardTrainer.compute_loss``:
Bradley-Terry, ``-logsigmoid(r_chosen - r_rejected - margin)``, plus
``center_rewards_coefficient * (r_chosen + r_rejected)^2`` when set (Eisenstein et al.'s
centring, which keeps the rewards near 0)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# Per pair: whether the chosen side scores higher, the reward margin, the pair's mean reward.
STATS = ("accuracy", "margin", "mean_reward")


class RewardLosses(NamedTuple):
    """Each pair's loss, (pairs,), and its :data:`STATS`, (pairs, 3)."""

    losses: torch.Tensor
    stats: torch.Tensor


def bradley_terry_loss(
    rewards: torch.Tensor,
    margin: torch.Tensor,
    center_rewards_coefficient: float | None = None,
) -> RewardLosses:
    """Per pair, from the (pairs, 2) rewards of chosen and rejected and the (pairs,) margins
    (0 for none): TRL's loss, with the centring term where ``center_rewards_coefficient`` is
    set, and its metrics."""
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    chosen, rejected = chosen.detach(), rejected.detach()
    stats = torch.stack(
        [(chosen > rejected).float(), chosen - rejected, (chosen + rejected) / 2], dim=1
    )
    return RewardLosses(losses, stats)
