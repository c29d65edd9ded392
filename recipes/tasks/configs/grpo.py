"""``task=grpo``: group relative policy optimisation on rewards that code checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recipes.errors import ConfigError
from recipes.tasks.configs import TaskConfig, at_least, feature, null_or_at_least
from recipes.tasks.configs.dpo import PADDING_FREE_RANGE
from recipes.tasks.configs.sft import check_text_rows

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The losses that clip the ratio as PPO does (task.delta caps their unclipped ratio too).
CLIPPED_LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo")


def _positive(value: Any) -> bool:
    return value is not None and value > 0


@dataclass
class GrpoConfig(TaskConfig):
    """Group relative policy optimisation on rewards that code checks: per prompt,
    ``num_generations`` sampled completions scored by ``rewards``, advantages within each group,
    TRL's clipped policy-gradient step. Defaults are TRL 1.16's GRPOConfig
    (docs/configuration.md#reinforcement-learning-with-verifiable-rewards-taskgrpo)."""

    NAME = "grpo"
    RANGES = (
        (
            "num_generations",
            at_least(2),
            "must be >= 2 (advantages compare completions of one prompt; TRL's default is 8)",
        ),
        ("num_iterations", at_least(1), "must be >= 1"),
        ("beta", at_least(0), "must be >= 0 (0: no KL term, TRL's default)"),
        ("epsilon", _positive, "must be > 0 (TRL's default is 0.2)"),
        (
            "epsilon_high",
            lambda v: v is None or v > 0,
            "must be > 0, or null for task.epsilon",
        ),
        (
            "delta",
            lambda v: v is None or v > 1,
            "must be > 1 (a cap on the ratio; INTELLECT-2 takes it above 1 + task.epsilon_high), "
            "or null for none",
        ),
        ("sapo_temperature_neg", _positive, "must be > 0 (TRL's default is 1.05)"),
        ("sapo_temperature_pos", _positive, "must be > 0 (TRL's default is 1.0)"),
        ("vespo_k_pos", at_least(0), "must be >= 0 (TRL's default is 2.0)"),
        ("vespo_lambda_pos", _positive, "must be > 0 (TRL's default is 3.0)"),
        ("vespo_k_neg", at_least(0), "must be >= 0 (TRL's default is 3.0)"),
        ("vespo_lambda_neg", _positive, "must be > 0 (TRL's default is 2.0)"),
        (
            "off_policy_mask_threshold",
            lambda v: v is None or v > 0,
            "must be > 0 (DeepSeek-V3.2's delta, e.g. 0.5), or null for no masking",
        ),
        ("temperature", _positive, "must be > 0 (completions are sampled)"),
        ("top_p", lambda v: v is not None and 0 < v <= 1, "must be in (0, 1]"),
        ("max_prompt_length", at_least(1), "must be >= 1"),
        ("max_completion_length", at_least(1), "must be >= 1"),
        ("num_held_out_answers", at_least(0), "must be >= 0"),
        PADDING_FREE_RANGE,
        ("max_tool_calling_iterations", null_or_at_least(1), "must be >= 1, or null (no limit)"),
        ("tool_timeout", _positive, "must be > 0 (seconds a tool call may run)"),
    )

    _target_: str = "recipes.tasks.grpo.GroupRelativePolicy"
    # null: the tokenizer's; chatml, llama3, zephyr, or a Jinja file (base models)
    chat_template: str | None = feature(None)
    # Plain-string prompts: chat (a user turn, templated) or raw (text as it is).
    text_rows: str = feature("chat")
    max_prompt_length: int = feature(512)  # a longer prompt keeps its last tokens
    max_completion_length: int = 512  # TRL's default; tokens per sampled completion
    num_generations: int = 8  # completions per prompt (the group), TRL's default
    temperature: float = 1.0  # sampling, as TRL: temperature 1, top_p 1, top_k 0 (off)
    top_p: float = 1.0
    top_k: int = 0
    # dapo (TRL's default), grpo, bnpo, dr_grpo, cispo, sapo, luspo or vespo
    loss_type: str = "dapo"
    beta: float = 0.0  # KL to the reference (TRL's default 0: no reference model)
    epsilon: float = 0.2  # clip range of the ratio to the old policy, below ...
    epsilon_high: float | None = None  # ... and above (null: epsilon; DAPO uses 0.28)
    num_iterations: int = 1  # optimizer steps on each generation batch (TRL's mu)
    scale_rewards: str = "group"  # group (TRL's default), batch or none (Dr. GRPO)
    # true: completions cut at max_completion_length carry no loss (DAPO).
    mask_truncated_completions: bool = False
    # token (TRL's default): a ratio per token; sequence (GSPO): the exp of the mean log-ratio
    # over each completion's tokens, one ratio per completion (luspo needs it; vespo refuses it).
    importance_sampling_level: str = "token"
    # null (TRL's default): one-sided clipping; a number caps the unclipped ratio too
    # (INTELLECT-2's two-sided clipping; dapo, grpo, bnpo, dr_grpo and luspo only).
    delta: float | None = None
    # sapo: the soft gate's temperature for tokens of non-positive / positive advantage (TRL's).
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    # vespo: the Gamma weight e^lambda w^k e^(-lambda w) of each completion's ratio w, for
    # advantages >= 0 (pos) and < 0 (neg): k damps w < 1, lambda damps w > 1 (TRL's defaults).
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # null (TRL's default): off; a number drops the completions of negative advantage whose mean
    # KL from the old policy exceeds it (DeepSeek-V3.2's off-policy sequence mask).
    off_policy_mask_threshold: float | None = None
    # true (TRL's default): the KL term times the ratio to the old policy (unbiased gradient).
    use_bias_correction_kl: bool = True
    # Reward functions, summed with their weights: a built-in (answer_match, answer_f1,
    # math_answer, format, length) or an import path package.module:function with TRL's
    # signature; other keys are the function's options (column: the answer's column; pattern:
    # format's regex).
    rewards: list[Any] = field(default_factory=lambda: [{"name": "answer_f1", "weight": 1.0}])
    # Held-out prompts answered greedily after training (generations.jsonl, EM and F1).
    num_held_out_answers: int = 8
    # auto: the loss's forward on a micro-batch's prompt + completion sequences as one row
    # without padding where the model's attention runs a variable-length kernel (flash
    # attention), else padded rows; true: that row everywhere (elsewhere under a dense
    # block-diagonal mask: exact, not faster); false: padded rows.
    padding_free: str = "auto"
    # Multi-turn tool calling (TRL's tools=, recipes/tool_calling.py): functions with type hints
    # and a Google-style docstring, by import path (recipes.tools.calculator); the chat template
    # shows them to the model, their results come back as tool messages (no loss on them).
    tools: list[str] = field(default_factory=list)
    # Rounds of tool calls per completion (null: no limit but max_completion_length, TRL's).
    max_tool_calling_iterations: int | None = None
    # Seconds a tool call may run; past it the model gets an error message and the run goes on.
    tool_timeout: float = 10.0

    def check(self) -> None:
        self.choose(
            "loss_type", LOSS_TYPES, f"{', '.join(LOSS_TYPES)} (TRL's; dapo is its default)"
        )
        self.choose("scale_rewards", SCALE_REWARDS)
        self.choose(
            "importance_sampling_level",
            IMPORTANCE_SAMPLING_LEVELS,
            "token (TRL's default) or sequence (GSPO)",
        )
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ConfigError(
                "task.loss_type=luspo is GSPO's sequence-level loss scaled by each completion's "
                "length: set task.importance_sampling_level=sequence."
            )
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise ConfigError(
                "task.loss_type=vespo weighs each completion by its own sequence-level ratio: "
                "set task.importance_sampling_level=token (the default)."
            )
        if self.delta is not None and self.loss_type not in CLIPPED_LOSSES:
            raise ConfigError(
                f"task.delta={self.delta} caps the clipped ratio of {', '.join(CLIPPED_LOSSES)}; "
                f"task.loss_type={self.loss_type} has none: set task.delta=null."
            )
        if not self.rewards:
            raise ConfigError(
                "task.rewards is empty: name at least one reward function "
                "(docs/configuration.md#reinforcement-learning-with-verifiable-rewards-taskgrpo)."
            )
        check_text_rows(self.text_rows)
        if self.tools:
            check_tools(self.text_rows)


# transformers' tokenizer.parse_response with response templates, which reads tool calls.
TOOLS_MIN_TRANSFORMERS = "5.13"


def check_tools(text_rows: str) -> None:
    """task.tools needs chat prompts and a transformers that parses tool calls."""
    from importlib.metadata import version

    from packaging.version import Version

    installed = version("transformers")
    if Version(installed) < Version(TOOLS_MIN_TRANSFORMERS):
        raise ConfigError(
            f"task.tools needs transformers >= {TOOLS_MIN_TRANSFORMERS} (its "
            f"tokenizer.parse_response reads the model's tool calls); this is {installed}: "
            "upgrade transformers, or leave task.tools empty."
        )
    if text_rows == "raw":
        raise ConfigError(
            "task.tools with task.text_rows=raw: tools are shown to the model by the chat "
            "template; use task.text_rows=chat."
        )
