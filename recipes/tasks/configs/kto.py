"""``task=kto``: Kahneman-Tversky optimisation on unpaired rows judged desirable or not."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.errors import ConfigError
from recipes.tasks.configs import at_least
from recipes.tasks.configs.dpo import PADDING_FREE_RANGE, PAIR_FORMATS
from recipes.tasks.configs.sft import CHAT_RANGES, ChatConfig

# TRL's unpaired rows, or preference pairs unpaired (recipes.tasks.chat.unpaired reads them).
UNPAIRED_FORMATS = ("auto", "unpaired", *PAIR_FORMATS[1:])
LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass
class KtoConfig(ChatConfig):
    """Kahneman-Tversky optimisation on unpaired rows (a prompt, one completion and whether it
    is desirable), after SFT: TRL's KTOTrainer losses and metrics. ``format``: unpaired
    (prompt/completion/label), a pair layout (explicit, implicit, ultrafeedback) unpaired into a
    desirable and an undesirable row, or auto; ``max_seq_length`` counts prompt + completion per
    row (TRL's max_length). The held-out prompts are those of desirable rows."""

    NAME = "kto"
    FORMATS = UNPAIRED_FORMATS
    RANGES = (
        *CHAT_RANGES,
        ("beta", lambda v: v is not None and v > 0, "must be > 0 (TRL's default is 0.1)"),
        ("desirable_weight", at_least(0), "must be >= 0 (TRL's default is 1.0)"),
        ("undesirable_weight", at_least(0), "must be >= 0 (TRL's default is 1.0)"),
        PADDING_FREE_RANGE,
    )

    _target_: str = "recipes.tasks.kto.KahnemanTversky"
    beta: float = 0.1  # pull towards the reference (TRL's default)
    loss_type: str = "kto"  # kto (with the batch's KL estimate) or apo_zero_unpaired (no KL term)
    # Weight of a desirable row's loss (TRL's default); balance unequal counts (the log suggests
    # a range).
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0  # weight of an undesirable row's loss (TRL's default)
    # true (apo_zero_unpaired only): the reference's log-probs computed once before training.
    precompute_reference: bool = False
    # No dropout, as TRL: the policy's log-probs are those the reference sees.
    disable_dropout: bool = True
    # auto: a micro-batch's rows (and KL rows) as one row without padding where the model's
    # attention runs a variable-length kernel (flash attention), else padded rows; true: that
    # row everywhere (elsewhere under a dense block-diagonal mask: exact, not faster); false:
    # padded rows.
    padding_free: str = "auto"

    def check(self) -> None:
        self.check_format()
        self.choose("loss_type", LOSS_TYPES)
        if not self.desirable_weight + self.undesirable_weight > 0:
            raise ConfigError("task.desirable_weight and task.undesirable_weight are both 0.")
        if self.precompute_reference and self.loss_type == "kto":
            raise ConfigError(
                "task.precompute_reference=true with task.loss_type=kto: the KL estimate pairs "
                "each row's prompt with another completion of its micro-batch, drawn anew each "
                "epoch, so the reference's log-probs of those pairs cannot be computed "
                "beforehand; keep the reference live (the LoRA adapter disabled, or a frozen "
                "copy), or use task.loss_type=apo_zero_unpaired (no KL term)."
            )
        self.check_rows()
