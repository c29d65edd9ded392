"""Preference losses on pairs of completions, chosen and rejected, as TRL (1.x) computes them.

Every function takes the (pairs, 2) summed log-probabilities of each pair's chosen and rejected
completion (column 0 chosen, column 1 rejected) and returns a :class:`PairLosses`: the loss of
each pair, and TRL's metrics of each pair, (pairs, len(names)), in the order
:func:`stat_names` gives them. The caller sums or averages over pairs.

With a reference model (:func:`dpo_loss`):

* ``sigmoid``: DPO (Rafailov et al.), ``-logsigmoid(beta * (ratio_chosen - ratio_rejected))``
  with ``ratio = log pi - log pi_ref``;
* ``ipo``: IPO on log-ratios divided by each completion's tokens (TRL's normalisation,
  confirmed by IPO's authors), ``(chosen - rejected - 1 / (2 beta))^2``;
* ``robust``: robust DPO, unbiased under a share ``label_smoothing`` of flipped labels.

Without one, as TRL 1.16 defines them (trl/experimental/orpo/orpo_trainer.py and
orpo_config.py; trl/experimental/cpo/cpo_trainer.py and cpo_config.py, SimPO being
CPOTrainer's ``loss_type="simpo"``), on the policy's average log-probability per completion
token of each side, ``a_c`` and ``a_r`` (TRL's ``get_batch_logps(average_log_prob=True)``);
rewards are ``beta * a``:

* ``orpo`` (:func:`orpo_loss`; ORPOConfig's defaults: beta=0.1): per pair
  ``nll(chosen) - beta * logsigmoid(log_odds)``,
  ``log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))``;
* ``simpo`` (:func:`simpo_loss`; CPOConfig's defaults: beta=0.1, simpo_gamma=0.5,
  label_smoothing=0.0, cpo_alpha=1.0, alpha=0.0, AlphaPO off): per pair, with
  ``z = beta * (a_c - a_r) - gamma``,
  ``-(1 - ls) * logsigmoid(z) - ls * logsigmoid(-z) + nll_weight * nll(chosen)`` (``ls`` the
  label smoothing, the conservative form, not robust DPO's). TRL's ``cpo_alpha=1.0`` default is
  CPO's behaviour-cloning term; pure SimPO has none (the SimPO paper; TRL's
  docs/source/cpo_trainer.md: SimPO "does not use BC regularization ... loss_type="simpo" and
  cpo_alpha=0"; cpo_alpha > 0 is their "CPO-SimPO"; cpo_config.py's alphapo also sets
  cpo_alpha=0.0), so ``nll_weight`` defaults to 0. The SimPO paper trains with beta ~2-2.5 and
  gamma/beta ~0.5.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

# The losses on log-ratios to a reference model (the others: orpo, simpo).
DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust")
# TRL's metrics of every loss, per pair: rewards are beta times the log-ratio (or, without a
# reference, times the average log-probability), log-probs the policy's.
STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
NLL_STATS = ("nll_loss",)
ORPO_STATS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


class PairLosses(NamedTuple):
    """Each pair's loss, (pairs,), and its metrics, (pairs, len(stat_names(...)))."""

    losses: torch.Tensor
    stats: torch.Tensor


def stat_names(loss_type: str, with_nll: bool = False) -> tuple[str, ...]:
    """The names of the columns of :attr:`PairLosses.stats` for ``loss_type`` (``with_nll``:
    SimPO with an NLL term)."""
    if loss_type == "orpo":
        return STATS + ORPO_STATS
    return STATS + (NLL_STATS if loss_type == "simpo" and with_nll else ())


def preference_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor | None,
    tokens: torch.Tensor,
    nll: torch.Tensor | None,
    *,
    loss_type: str,
    beta: float,
    label_smoothing: float,
    simpo_gamma: float,
    nll_weight: float,
) -> PairLosses:
    """``loss_type``'s losses and metrics under every setting of a DPO task (those its loss
    does not read are ignored): :func:`dpo_loss` (``reference_logps`` given), :func:`orpo_loss`
    or :func:`simpo_loss` (no reference, ``reference_logps`` None; ``nll`` the chosen side's
    NLL per pair, or None where the loss reads none)."""
    if loss_type == "orpo":
        if nll is None:
            raise ValueError("orpo needs the chosen side's NLL")
        return orpo_loss(policy_logps, tokens, nll, beta=beta)
    if loss_type == "simpo":
        return simpo_loss(
            policy_logps,
            tokens,
            nll,
            beta=beta,
            gamma=simpo_gamma,
            label_smoothing=label_smoothing,
            nll_weight=nll_weight,
        )
    if reference_logps is None:
        raise ValueError(f"loss_type={loss_type!r} needs the reference's log-probabilities")
    return dpo_loss(
        policy_logps,
        reference_logps,
        tokens,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
    )


def dpo_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    tokens: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PairLosses:
    """DPO, IPO or robust DPO from the (pairs, 2) summed log-probs of the policy and the
    reference and the completions' tokens (IPO reads them); metrics :data:`STATS`."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose {', '.join(DPO_LOSS_TYPES)}")
    ratios = policy_logps - reference_logps  # log pi / pi_ref of chosen, rejected
    if loss_type == "ipo":  # per token (TRL's normalisation, confirmed by IPO's authors)
        per_token = ratios / tokens.clamp(min=1)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    else:
        scaled = beta * (ratios[:, 0] - ratios[:, 1])
        losses = -F.logsigmoid(scaled)
        if loss_type == "robust":  # unbiased under a share of flipped labels
            flip = label_smoothing
            losses = (losses * (1 - flip) + F.logsigmoid(-scaled) * flip) / (1 - 2 * flip)
    return PairLosses(losses, reward_stats(beta * ratios, policy_logps))


def orpo_loss(
    policy_logps: torch.Tensor, tokens: torch.Tensor, nll: torch.Tensor, *, beta: float
) -> PairLosses:
    """ORPO from the (pairs, 2) summed log-probs of the policy, the completions' tokens and the
    chosen side's NLL per pair (TRL's: over the whole chosen row, prompt included); metrics
    :data:`STATS` and :data:`ORPO_STATS`."""
    average = average_logps(policy_logps, tokens)
    chosen, rejected = average[:, 0], average[:, 1]
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    losses = nll - beta * ratio
    extra = [nll.detach(), ratio.detach(), log_odds.detach()]
    return PairLosses(losses, _with_columns(reward_stats(beta * average, average), extra))


def simpo_loss(
    policy_logps: torch.Tensor,
    tokens: torch.Tensor,
    nll: torch.Tensor | None = None,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
    nll_weight: float = 0.0,
) -> PairLosses:
    """SimPO (CPO-SimPO with ``nll_weight`` > 0, the chosen completion's NLL per pair in
    ``nll``) from the (pairs, 2) summed log-probs of the policy and the completions' tokens;
    metrics :data:`STATS`, and :data:`NLL_STATS` with ``nll_weight`` > 0."""
    average = average_logps(policy_logps, tokens)
    chosen, rejected = average[:, 0], average[:, 1]
    margin = beta * (chosen - rejected) - gamma
    losses = -F.logsigmoid(margin) * (1 - label_smoothing) - F.logsigmoid(-margin) * label_smoothing
    extra: list[torch.Tensor] = []
    if nll_weight > 0:
        if nll is None:
            raise ValueError("simpo with nll_weight > 0 needs the chosen side's NLL")
        losses = losses + nll_weight * nll
        extra = [nll.detach()]
    return PairLosses(losses, _with_columns(reward_stats(beta * average, average), extra))


def average_logps(policy_logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-probability per completion token (fp32), TRL's ``average_log_prob=True``."""
    return policy_logps.float() / tokens.clamp(min=1)


def reward_stats(rewards: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """TRL's six metrics per pair, (pairs, 6) (:data:`STATS`), from the (pairs, 2) rewards and
    log-probs of chosen and rejected."""
    rewards, logps = rewards.detach(), logps.detach()
    return torch.stack(
        [
            rewards[:, 0],
            rewards[:, 1],
            (rewards[:, 0] > rewards[:, 1]).float(),
            rewards[:, 0] - rewards[:, 1],
            logps[:, 0],
            logps[:, 1],
        ],
        dim=1,
    )


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (each branch where it is accurate)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _with_columns(stats: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
    """``stats`` with each (pairs,) tensor of ``extra`` appended as a column."""
    return torch.cat([stats, *(value[:, None] for value in extra)], dim=1)
