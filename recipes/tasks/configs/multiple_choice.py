"""``task=multiple_choice``: pick the right one of several choices (SWAG-style)."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.tasks.configs import TaskConfig, at_least, feature


@dataclass
class MultipleChoiceConfig(TaskConfig):
    """One (context, header + choice) pair per choice, scored by the model's multiple-choice
    head; accuracy."""

    NAME = "multiple_choice"
    RANGES = (
        (
            "max_seq_length",
            at_least(8),
            "must be at least 8 (a context, a choice and the special tokens); run_swag uses 128",
        ),
    )

    _target_: str = "recipes.tasks.multiple_choice.MultipleChoice"
    # Each (context, header + choice) pair is cut to this many tokens, the longer text first.
    max_seq_length: int = feature(128)
