"""``task=classification``: sequence classification and regression (GLUE-style)."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.tasks.configs import TaskConfig, at_least, feature

PROBLEM_TYPES = ("auto", "single_label_classification", "regression")


@dataclass
class ClassificationConfig(TaskConfig):
    """A text or text pair classified (accuracy, F1, Matthews) or scored (Pearson, Spearman)."""

    NAME = "classification"
    RANGES = (("max_seq_length", at_least(2), "must be at least 2"),)

    _target_: str = "recipes.tasks.classification.SequenceClassification"
    max_seq_length: int = feature(128)  # longer inputs are cut (the longer text of a pair first)
    # auto (regression for a GLUE regression task, or float labels that are not whole numbers)
    # | single_label_classification | regression
    problem_type: str = "auto"
    # Ranks checkpoints; null: the GLUE task's metric, else accuracy / pearson.
    metric: str | None = None

    def check(self) -> None:
        self.choose("problem_type", PROBLEM_TYPES, f"one of {', '.join(PROBLEM_TYPES)}")
