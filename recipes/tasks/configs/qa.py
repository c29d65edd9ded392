"""``task=qa``: extractive question answering (SQuAD v1.1 / v2.0)."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.errors import ConfigError
from recipes.tasks.configs import TaskConfig, at_least, feature

_AT_LEAST_1 = "must be at least 1"


@dataclass
class QaConfig(TaskConfig):
    """Questions and contexts in windows of ``max_seq_length`` tokens; answers read back from
    the start / end logits; EM / F1."""

    NAME = "qa"
    RANGES = tuple(
        (key, at_least(1), _AT_LEAST_1)
        for key in ("max_seq_length", "n_best_size", "max_answer_length", "doc_stride")
    )

    _target_: str = "recipes.tasks.qa.QuestionAnswering"
    max_seq_length: int = feature(384)  # question + context window, in tokens
    doc_stride: int = feature(128)  # overlap between windows of a long context; < max_seq_length
    max_query_length: int = feature(64)  # longer questions are cut (keeps room for the context)
    n_best_size: int = 20  # start/end candidates per window considered for the answer
    max_answer_length: int = 30  # longest answer span, in tokens
    version_2_with_negative: bool = False  # SQuAD v2.0: a question may have no answer
    null_score_diff_threshold: float = 0.0  # v2: predict "no answer" when null - best span > this
    write_nbest: bool = True  # also write nbest_predictions.json at each evaluation
    # Leave the padding's positions out of the answer softmax (transformers' QA head scores
    # them): no loss then depends on padding, and trainer.sub_batches is exact. false: the
    # head's own loss.
    loss_ignores_padding: bool = True

    def check(self) -> None:
        if self.doc_stride >= self.max_seq_length:
            raise ConfigError(
                f"task.doc_stride={self.doc_stride} must be smaller than task.max_seq_length="
                f"{self.max_seq_length} (windows would not advance); the reference uses 128 and "
                "384."
            )
        if self.max_query_length >= self.max_seq_length - self.doc_stride:
            raise ConfigError(
                f"task.max_query_length={self.max_query_length} leaves no room for context in a "
                f"{self.max_seq_length}-token window with doc_stride {self.doc_stride}; lower it."
            )
