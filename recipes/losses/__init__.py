"""The losses of the preference and RL tasks as pure functions of tensors and settings.

Each takes log-probabilities (or logits, rewards, advantages), masks and plain settings, and
returns the loss and its statistics; the tasks (``recipes.tasks``) gather the log-probabilities
from their models and call them, and the comparisons with TRL in ``tests/`` call them directly.
No model, tokenizer, accelerator or task state here: this package imports only torch.

* :mod:`recipes.losses.preference`: DPO / IPO / robust DPO, and ORPO and SimPO (CPO-SimPO)
  without a reference;
* :mod:`recipes.losses.kto`: KTO and APO-zero on unpaired rows, and KTO's KL estimate;
* :mod:`recipes.losses.grpo`: GRPO's group advantages and its policy losses (every
  ``loss_type``, token- or sequence-level ratios, clipping, masking and the KL term);
* :mod:`recipes.losses.gkd`: GKD's generalized Jensen-Shannon divergence;
* :mod:`recipes.losses.reward`: a reward model's Bradley-Terry loss with margin and centring.
"""

from recipes.losses.gkd import distillation_loss, generalized_jsd
from recipes.losses.grpo import (
    GroupAdvantages,
    PolicyLoss,
    PolicyLossSettings,
    group_advantages,
    policy_loss,
)
from recipes.losses.kto import RowLosses, kl_estimate, kto_loss
from recipes.losses.preference import (
    PairLosses,
    dpo_loss,
    orpo_loss,
    preference_loss,
    simpo_loss,
)
from recipes.losses.reward import RewardLosses, bradley_terry_loss

__all__ = [
    "GroupAdvantages",
    "PairLosses",
    "PolicyLoss",
    "PolicyLossSettings",
    "RewardLosses",
    "RowLosses",
    "bradley_terry_loss",
    "distillation_loss",
    "dpo_loss",
    "generalized_jsd",
    "group_advantages",
    "kl_estimate",
    "kto_loss",
    "orpo_loss",
    "policy_loss",
    "preference_loss",
    "simpo_loss",
]
