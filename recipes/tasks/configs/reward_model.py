"""``task=reward_model``: a reward model trained on preference pairs, as TRL's RewardTrainer.

Defaults are TRL 1.16's RewardConfig (trl/trainer/reward_config.py) where the setting is the
same: ``max_length=1024`` (here ``max_seq_length``), samples longer than it filtered out (here
``truncation=drop``), ``center_rewards_coefficient=None`` (off), ``disable_dropout=True``. Its
``learning_rate=1e-4`` is the recipe's (conf/recipe/llama_rm.yaml).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.tasks.configs import feature
from recipes.tasks.configs.dpo import PAIR_FORMATS
from recipes.tasks.configs.sft import ROW_RANGES, TRUNCATION, ChatRowsConfig, check_text_rows


@dataclass
class RewardModelConfig(ChatRowsConfig):
    """A sequence classifier with one output (the reward) trained on preference pairs so that
    the chosen side scores above the rejected one (TRL's RewardTrainer loss and metrics). The
    rows (:class:`ChatRowsConfig`) are pairs: ``format`` explicit (prompt/chosen/rejected),
    implicit (chosen/rejected sharing a prompt), ultrafeedback or auto, an optional margin
    column (a number per pair) subtracted inside the loss, as TRL; ``max_seq_length`` counts
    prompt + completion per side (TRL's max_length, 1024). The chat template is saved with
    final/'s tokenizer: what GRPO renders completions with when it uses the model as a
    reward."""

    NAME = "reward_model"
    FORMATS = PAIR_FORMATS
    RANGES = (
        *ROW_RANGES,
        (
            "center_rewards_coefficient",
            lambda v: v is None or (0 <= v < math.inf),
            "must be null (off) or a finite number >= 0 (TRL recommends 0.01)",
        ),
    )

    _target_: str = "recipes.tasks.reward_model.RewardModel"
    # A longer side: drop (leave the pair out: TRL filters such samples) or truncate (cut its
    # end: the reward then reads a cut reply).
    truncation: str = feature("drop")
    # Weight of mean((r_chosen + r_rejected)^2) added to the loss, which keeps rewards centred on
    # zero (Eisenstein et al. 2023, Eq. 2); null: off (TRL's default), 0.01 TRL's suggestion.
    center_rewards_coefficient: float | None = None
    # No dropout, as TRL: the rewards of a step are those evaluation sees.
    disable_dropout: bool = True

    def check(self) -> None:
        self.check_format()
        check_text_rows(self.text_rows)
        self.choose(
            "truncation",
            TRUNCATION,
            "drop (leave a pair with a side longer than task.max_seq_length out, as TRL) or "
            "truncate (cut its end)",
        )
