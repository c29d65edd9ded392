"""``task=dpo``: direct preference optimisation on preference pairs, and the reference-free
ORPO and SimPO losses."""

from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.errors import ConfigError
from recipes.tasks.configs import feature
from recipes.tasks.configs.sft import CHAT_RANGES, ChatConfig

# The row layouts of preference pairs (recipes.tasks.chat.preference reads them).
PAIR_FORMATS = ("auto", "explicit", "implicit", "ultrafeedback")
REFERENCE_FREE = ("orpo", "simpo")  # the losses without a reference model (recipes.tasks.dpo)
LOSS_TYPES = ("sigmoid", "ipo", "robust", *REFERENCE_FREE)
PADDING_FREE = ("auto", "true", "false")  # task.padding_free (DPO, KTO, GRPO)
PADDING_FREE_RANGE = (
    "padding_free",
    lambda v: str(v).lower() in PADDING_FREE,
    "choose auto, true or false",
)


def finite_at_least_zero(value: float) -> bool:
    return value is not None and 0 <= value < math.inf


@dataclass
class DpoConfig(ChatConfig):
    """Direct preference optimisation on preference pairs (a prompt, a chosen and a rejected
    reply), after SFT: sigmoid DPO, IPO or robust DPO against a reference model, or ORPO /
    SimPO without one; TRL's losses and metrics. The rows (:class:`ChatRowsConfig`) are pairs:
    ``format`` explicit (prompt/chosen/rejected), implicit (chosen/rejected sharing a prompt),
    ultrafeedback or auto; ``max_seq_length`` counts prompt + completion per side, and a side
    longer than it is cut (``truncation=truncate``) or leaves its pair out (``drop``)."""

    NAME = "dpo"
    FORMATS = PAIR_FORMATS
    RANGES = (
        *CHAT_RANGES,
        ("beta", lambda v: v is not None and v > 0, "must be > 0 (TRL's default is 0.1)"),
        (
            "label_smoothing",
            lambda v: v is not None and 0 <= v < 0.5,
            "must be in [0, 0.5) (the share of pairs assumed mislabelled)",
        ),
        (
            "simpo_gamma",
            finite_at_least_zero,
            "must be a finite number >= 0 (SimPO's target reward margin; TRL's default is 0.5)",
        ),
        ("nll_weight", finite_at_least_zero, "must be a finite number >= 0"),
        PADDING_FREE_RANGE,
    )

    _target_: str = "recipes.tasks.dpo.DirectPreference"
    # Pull towards the reference (TRL's default for DPO, ORPO and SimPO); orpo: weight of the
    # odds-ratio term; simpo: scale of the margin (the SimPO paper uses ~2-2.5).
    beta: float = 0.1
    # sigmoid (DPO), ipo (on length-normalised log-probs), robust (with label_smoothing); no
    # reference model: orpo (odds ratio + NLL of the chosen row), simpo (length-normalised
    # margin).
    loss_type: str = "sigmoid"
    # robust: share of pairs assumed mislabelled; simpo: TRL's conservative smoothing (as TRL).
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5  # simpo only: target reward margin (TRL's default)
    # simpo only: weight of the chosen completion's NLL (TRL's cpo_alpha, 1.0 there: CPO-SimPO);
    # 0: pure SimPO.
    nll_weight: float = 0.0
    # true: the reference's log-probs computed once before training (no reference forward per
    # step, no frozen copy); refused with orpo / simpo (no reference).
    precompute_reference: bool = False
    # auto: a micro-batch's sides as one row without padding where the model's attention runs
    # a variable-length kernel (flash attention), else padded rows; true: that row under flash,
    # elsewhere a pair per row under a block-diagonal mask; false: padded rows.
    padding_free: str = feature("auto")
    # No dropout, as TRL: the policy's log-probs are those the reference sees.
    disable_dropout: bool = True

    def check(self) -> None:
        self.check_format()
        self.choose("loss_type", LOSS_TYPES)
        if self.label_smoothing and self.loss_type not in ("robust", "simpo"):
            raise ConfigError(
                f"task.label_smoothing={self.label_smoothing} is for task.loss_type=robust "
                "(robust DPO) or simpo, where TRL applies it; set it there, or to 0."
            )
        if self.nll_weight and self.loss_type != "simpo":
            raise ConfigError(
                f"task.nll_weight={self.nll_weight} is for task.loss_type=simpo (TRL's "
                "cpo_alpha); ORPO's NLL term is always in its loss; set it to 0."
            )
        if self.precompute_reference and self.loss_type in REFERENCE_FREE:
            raise ConfigError(
                f"task.precompute_reference=true: task.loss_type={self.loss_type} uses no "
                "reference model; set task.precompute_reference=false."
            )
        self.check_rows()
