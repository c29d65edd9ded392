"""Group relative policy optimisation's advantages and policy losses, as TRL 1.16's
``GRPOTrainer`` computes them (``trl/trainer/grpo_trainer.py``, ``_compute_loss``).

:func:`group_advantages` turns the rewards of each prompt's group of completions into
advantages; :func:`policy_loss` is the micro-batch's loss from the per-token log-probabilities
of the completions under the policy (with gradient), the old policy (that sampled them) and the
reference, for every ``loss_type`` and importance-sampling level (:class:`PolicyLossSettings`):

* ``loss_type``: ``dapo`` (every completion token of the step weighs the same), ``grpo`` (each
  completion's token mean, then the mean over completions), ``bnpo`` (the token mean of the
  micro-batch), ``dr_grpo`` (the token sum over completions x ``max_completion_length``);
  ``cispo`` and ``vespo`` (normalised as dapo: the capped ratio, or VESPO's Gamma weight of the
  completion's ratio, detached, times the log-prob), ``sapo`` (as grpo: a soft gate instead of
  the clip), ``luspo`` (each completion's token sum, its mean over completions);
* ``importance_sampling_level``: a ratio per token, or per completion (GSPO); ``delta`` caps the
  unclipped ratio (two-sided clipping), ``off_policy_mask_threshold`` drops the completions of
  negative advantage too far from the old policy (DeepSeek-V3.2);
* ``beta``: the k3 estimate of KL to the reference, times the ratio to the old policy with
  ``use_bias_correction_kl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
# Losses normalised by the step's completion tokens (TRL's num_items_in_batch).
TOKEN_SUMS = ("dapo", "cispo", "vespo")
# The statistics each loss type gives (besides "kl" with beta > 0): the clipped ones', and
# those of the losses that do not clip as PPO does.
CLIP_STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
LOSS_STATS = {"cispo": ("cispo_clip_ratio",), "sapo": (), "vespo": ("vespo/phi_seq_mean",)}
# The reward statistics of :func:`group_advantages`, then per reward function its mean and std.
REWARD_STATS = ("reward", "reward_std", "frac_reward_zero_std")


@dataclass(frozen=True)
class PolicyLossSettings:
    """What :func:`policy_loss` reads of the task's settings (their meaning and TRL's defaults:
    :class:`recipes.tasks.configs.grpo.GrpoConfig`); :meth:`of` takes them from it."""

    loss_type: str
    importance_sampling_level: str  # "token", or "sequence" (GSPO)
    epsilon: float  # clip range of the ratio, below ...
    epsilon_high: float | None  # ... and above (None: epsilon)
    delta: float | None  # a cap on the unclipped ratio (two-sided clipping), or None
    off_policy_mask_threshold: float | None
    beta: float  # weight of the KL to the reference (0: none)
    use_bias_correction_kl: bool
    max_completion_length: int  # dr_grpo's normaliser
    # sapo's gate temperatures, and vespo's Gamma shape (k) and rate (lambda), by the sign of
    # the advantage.
    sapo_temperature_neg: float
    sapo_temperature_pos: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: choose {', '.join(LOSS_TYPES)}")

    @classmethod
    def of(cls, settings: Any) -> PolicyLossSettings:
        """The fields of the same names of ``settings`` (the task's config)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def high(self) -> float:
        """The clip range above the ratio: ``epsilon_high``, or ``epsilon``."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class PolicyLoss(NamedTuple):
    """The micro-batch's loss as a sum, its count of terms (the loss is ``total / count``
    over a step's micro-batches: per token, completion or micro-batch by ``loss_type``) and
    TRL's statistics (detached means over the micro-batch)."""

    total: torch.Tensor
    count: torch.Tensor
    stats: dict[str, torch.Tensor]


class GroupAdvantages(NamedTuple):
    """Each completion's advantage, (completions,), and the reward statistics TRL logs,
    (3 + 2 * functions,): :data:`REWARD_STATS`, then each function's mean and std
    (:func:`advantage_stat_names`)."""

    advantages: torch.Tensor
    stats: torch.Tensor


def stat_names(loss_type: str, beta: float) -> tuple[str, ...]:
    """The statistics :func:`policy_loss` gives for ``loss_type`` (and ``kl`` with ``beta``)."""
    return (*LOSS_STATS.get(loss_type, CLIP_STATS), *(("kl",) if beta else ()))


def advantage_stat_names(reward_names: Sequence[str]) -> tuple[str, ...]:
    """The names of :attr:`GroupAdvantages.stats` for reward functions ``reward_names``, as TRL
    logs them."""
    per_reward = [f"rewards/{name}/{stat}" for name in reward_names for stat in ("mean", "std")]
    return (*REWARD_STATS, *per_reward)


def group_advantages(
    per_func: torch.Tensor,
    weights: torch.Tensor,
    group: int,
    scale: str = "group",
    across_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> GroupAdvantages:
    """Advantages from the (completions, functions) rewards (NaN: not scored) and the
    functions' weights, as TRL's sum_then_normalize: each completion's weighted sum less its
    group's mean (``group`` consecutive completions per prompt), divided by the group's std
    (``scale="group"``), the whole batch's (``batch``; ``across_processes`` gathers every
    process's totals where there are several) or nothing (``none``); a completion no function
    scored gets 0. Its statistics: see :class:`GroupAdvantages`."""
    totals = (per_func * weights).nansum(dim=1)
    unscorable = torch.isnan(per_func).all(dim=1)
    totals[unscorable] = torch.nan
    grouped = totals.view(-1, group)
    means = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        everyone = totals if across_processes is None else across_processes(totals)
        std = nanstd(everyone).expand_as(totals)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    advantages = totals - means
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    values = [
        torch.nanmean(totals),
        nanstd(totals),
        # The std the advantages are scaled by (the group's under none), as TRL's is_std_zero.
        torch.isclose(std, torch.zeros_like(std)).float().mean(),
    ]
    for i in range(per_func.shape[1]):
        column = per_func[:, i]
        # NaN where the function scored none of them: logged as null, never a made-up 0.
        values += [torch.nanmean(column), nanstd(column)]
    return GroupAdvantages(advantages, torch.stack(values).float())


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: PolicyLossSettings,
) -> PolicyLoss:
    """The micro-batch's loss from the (rows, completion length) per-token log-probs of the
    policy, the old policy (None: the policy's, detached, so the ratio is 1) and the reference
    (needed with ``beta``), the (rows,) advantages and the completion mask: TRL's per-token loss
    and normalisation for ``settings.loss_type``; and the clip and KL statistics (means over the
    micro-batch's completion tokens, or its completions where the ratio is one per
    completion)."""
    mask = completion_mask.float()
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1)
    log_ratio = logps - old
    if settings.importance_sampling_level == "sequence":  # GSPO: (rows, 1)
        log_ratio_seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        ratio = torch.exp(log_ratio_seq).unsqueeze(-1)
    else:
        ratio = torch.exp(log_ratio)
    per_token, stats = _surrogate(logps, log_ratio, ratio, adv, mask, settings)
    if settings.off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_mask(
            adv, logps, old, mask, settings.off_policy_mask_threshold
        )
    if settings.beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + settings.beta * kl
        stats["kl"] = masked_mean(kl, mask)
    masked = per_token * mask  # a ratio per completion spreads over its tokens
    rows = mask.new_full((), float(len(mask)))  # a fill on the device, no copy from the host
    loss_type = settings.loss_type
    if loss_type in TOKEN_SUMS:
        total, count = masked.sum(), mask.sum()
    elif loss_type in ("grpo", "sapo"):
        total, count = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    elif loss_type == "bnpo":
        total, count = masked.sum() / mask.sum().clamp(min=1.0), torch.ones_like(rows)
    elif loss_type == "luspo":  # each completion's token sum: scaled by its length
        total, count = masked.sum(), rows
    else:  # dr_grpo
        total, count = masked.sum() / settings.max_completion_length, rows
    return PolicyLoss(total, count, {k: v.detach() for k, v in stats.items()})


def _surrogate(
    logps: torch.Tensor,
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    settings: PolicyLossSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_type``'s per-token loss (per completion where ``ratio`` is) before the KL term,
    and the statistics TRL logs for it."""
    high = settings.high
    if settings.loss_type == "cispo":  # the ratio clipped and detached, times the log-prob
        capped = torch.clamp(ratio, max=high).detach()
        clipped = ((ratio > high) & (adv > 0)).float()
        return -capped * adv * logps, {"cispo_clip_ratio": masked_mean(clipped, mask)}
    if settings.loss_type == "sapo":  # a soft, temperature-controlled gate instead of a clip
        temperatures = torch.where(
            adv > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg
        )
        gate = torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures
        return -gate * adv, {}
    if settings.loss_type == "vespo":
        phi = gamma_weights(log_ratio.detach(), adv, mask, settings)
        return -phi * adv * logps, {"vespo/phi_seq_mean": phi.mean()}
    low_bound, high_bound = 1 - settings.epsilon, 1 + high
    clipped = torch.clamp(ratio, low_bound, high_bound)
    if settings.delta is not None:  # two-sided clipping
        ratio = torch.clamp(ratio, max=settings.delta)
    per_token = -torch.min(ratio * adv, clipped * adv)
    low = ((ratio < low_bound) & (adv < 0)).float()
    high_clipped = ((ratio > high_bound) & (adv > 0)).float()
    return per_token, {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high_clipped, mask),
        "clip_ratio/region_mean": masked_mean(((low + high_clipped) > 0).float(), mask),
    }


def gamma_weights(
    log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, settings: PolicyLossSettings
) -> torch.Tensor:
    """VESPO's weight of each completion, (rows, 1): phi(w) = e^lambda w^k e^(-lambda w) of
    its sequence ratio w (the exp of its summed log-ratios), in log space, with k and lambda
    by the advantage's sign (TRL's ``get_gamma_weights``, no sampler correction)."""
    floor = math.log(1e-8)
    summed = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(summed, floor, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(nonneg, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(
    adv: torch.Tensor,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, (rows, 1): 0 for a completion of negative
    advantage whose mean KL from the old policy (old minus new log-prob) exceeds ``threshold``
    (TRL's ``get_off_policy_mask``)."""
    kl = torch.nan_to_num(old_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over completion tokens, or over completions for one value per completion."""
    if values.shape[1] == 1:
        return values.mean()
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaN, with Bessel's correction (TRL's ``nanstd``)."""
    if dim is None:
        values, dim = values.reshape(-1), 0
    count = (~torch.isnan(values)).sum(dim=dim).float()
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim) * count / (count - 1)
    return variance.sqrt()
