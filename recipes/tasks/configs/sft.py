"""``task=sft``: supervised fine-tuning on conversations; and the chat settings that SFT, DPO and
KTO share (:class:`ChatConfig`): how rows are read and rendered, their length policy
(:class:`ChatRowsConfig`, the reward model's too) and the held-out prompts answered after
training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from recipes.errors import ConfigError
from recipes.tasks.configs import TaskConfig, at_least, feature

# The row layouts of conversations (recipes.tasks.chat reads them).
FORMATS = ("auto", "messages", "sharegpt", "alpaca", "dolly", "prompt_completion")
TRUNCATION = ("truncate", "drop")
# task.text_rows: rows whose prompt and replies are plain strings (TRL's "standard" rows), as
# chat turns rendered with the template, or as text the way TRL tokenizes them.
TEXT_ROWS = ("chat", "raw")
ROW_RANGES = (("max_seq_length", at_least(2), "must be at least 2"),)
CHAT_RANGES = (*ROW_RANGES, ("num_generations", at_least(0), "must be >= 0"))


def check_text_rows(text_rows: str) -> None:
    """Refuse a ``task.text_rows`` that is neither chat nor raw."""
    if text_rows not in TEXT_ROWS:
        raise ConfigError(
            f"task.text_rows={text_rows!r}: choose chat (plain-string rows as a user turn and an "
            "assistant reply, rendered with the chat template) or raw (as text, as TRL)."
        )


@dataclass
class ChatRowsConfig(TaskConfig):
    """How a task reads chat rows: their layout, template and length policy (no task of its
    own: :class:`ChatConfig` and the reward model's settings extend it). A task's docstring
    says what its ``format`` choices are and what a row is."""

    FORMATS: ClassVar[tuple[str, ...]] = FORMATS
    RANGES = ROW_RANGES

    format: str = feature("auto")  # row layout: auto (detected per row), or the task's FORMATS
    # null: the tokenizer's; chatml, llama3, zephyr, or a Jinja file (base models)
    chat_template: str | None = feature(None)
    # Plain-string rows: chat (user turns and replies, templated) or raw (text as TRL: prompt +
    # completion + EOS, no template).
    text_rows: str = feature("chat")
    max_seq_length: int = feature(1024)  # tokens per row; at most the model's positions
    truncation: str = feature("truncate")  # a longer row: truncate (cut its end) or drop

    def check_format(self) -> None:
        self.choose("format", self.FORMATS)

    def check_rows(self) -> None:
        check_text_rows(self.text_rows)
        self.choose(
            "truncation",
            TRUNCATION,
            "truncate (cut the end of a long conversation) or drop (leave it out)",
        )


@dataclass
class ChatConfig(ChatRowsConfig):
    """The settings of a task that trains a causal LM on chat rows and answers held-out prompts
    after training (no task of its own: SFT, DPO and KTO extend it)."""

    RANGES = CHAT_RANGES

    # Held-out prompts answered greedily after training (generations.jsonl, EM and F1); the
    # run's generation.batch_size answers them together.
    num_generations: int = 4
    generation_max_new_tokens: int = 64


@dataclass
class SftConfig(ChatConfig):
    """Supervised fine-tuning on conversations: chat template, loss on the assistant's tokens
    only. ``format``: messages, sharegpt, alpaca, dolly, prompt_completion (or auto); a chat
    template's {% generation %} markers decide the labelled tokens."""

    NAME = "sft"

    _target_: str = "recipes.tasks.sft.SupervisedFineTuning"
    # Tokens per conversation (and per packed row); at most the model's positions.
    max_seq_length: int = feature(2048)
    train_on_prompt: bool = feature(False)  # true: system and user tokens carry loss too
    # true: several conversations per row, no attention between them (faster).
    packing: bool = feature(False)

    def check(self) -> None:
        self.check_rows()
        self.check_format()
