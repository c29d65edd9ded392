"""Sequence classification and regression, GLUE-style (``task=classification``).

What the task adds to the shared loop: finding the text, text-pair and label columns (from the
GLUE task named by ``data.name``, or ``data.text_column`` / ``data.text_pair_column`` /
``data.label_column``), mapping labels to ids, tokenizing, and scoring accuracy / F1 / Matthews
correlation, or Pearson / Spearman correlation for a regression target such as STS-B.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes.config import DataConfig
from recipes.data import DataError
from recipes.evaluation import gather_rows
from recipes.log import get_logger
from recipes.metrics.classification import classification_scores, regression_scores
from recipes.tasks.base import Averaging, LossShape, RunContext, Task, TaskData
from recipes.tasks.configs.classification import ClassificationConfig
from recipes.tasks.outputs import row_ids, write_predictions

log = get_logger(__name__)

FEATURES_VERSION = 1


@dataclass(frozen=True)
class GlueTask:
    """Column names (the Hub's first, then those of the original TSV files), label names in the
    Hub's id order (None for regression) and the metric GLUE ranks by."""

    text: Sequence[str]
    pair: Sequence[str] | None
    label: Sequence[str]
    labels: Sequence[str] | None
    metric: str


GLUE = {
    "cola": GlueTask(("sentence",), None, ("label",), ("unacceptable", "acceptable"),
                     "matthews_correlation"),
    "sst2": GlueTask(("sentence",), None, ("label",), ("negative", "positive"), "accuracy"),
    "mrpc": GlueTask(("sentence1", "#1 String"), ("sentence2", "#2 String"), ("label", "Quality"),
                     ("not_equivalent", "equivalent"), "f1"),
    "qqp": GlueTask(("question1",), ("question2",), ("label", "is_duplicate"),
                    ("not_duplicate", "duplicate"), "f1"),
    "stsb": GlueTask(("sentence1",), ("sentence2",), ("label", "score"), None, "pearson"),
    "mnli": GlueTask(("premise", "sentence1"), ("hypothesis", "sentence2"),
                     ("label", "gold_label"), ("entailment", "neutral", "contradiction"),
                     "accuracy"),
    "qnli": GlueTask(("question",), ("sentence",), ("label",), ("entailment", "not_entailment"),
                     "accuracy"),
    "rte": GlueTask(("sentence1",), ("sentence2",), ("label",), ("entailment", "not_entailment"),
                    "accuracy"),
    "wnli": GlueTask(("sentence1",), ("sentence2",), ("label",), ("not_entailment", "entailment"),
                     "accuracy"),
}  # fmt: skip


@dataclass
class ClassificationData(TaskData):
    """Features plus the label names, in id order (None: a regression target)."""

    label_names: list[str] | None = None
    row_ids: list[Any] | None = None  # mode=predict: each row's id (outputs.row_ids)


def glue_task(name: str | None) -> GlueTask | None:
    """The GLUE task called ``name`` (``SST-2``, ``sst2`` and ``STS-B`` all work)."""
    return GLUE.get((name or "").lower().replace("-", "").replace("_", ""))


class SequenceClassification(Task[ClassificationData]):
    """Classify a text or a text pair, or regress a score (``task=classification``).

    Args:
        max_seq_length: longer inputs are cut (the longer text of a pair first).
        problem_type: ``auto`` (regression for a GLUE regression task or float labels that are
            not whole numbers), ``single_label_classification`` or ``regression``.
        metric: the evaluation number that ranks checkpoints; null: the GLUE task's own, else
            accuracy (classification) or pearson (regression).
    """

    auto_model_class = AutoModelForSequenceClassification
    greater_is_better = True
    args: ClassificationConfig

    def __init__(self, args: ClassificationConfig) -> None:
        super().__init__(args)
        # Until build_data settles it from the data (a GLUE task's own metric, or regression's).
        self.main_metric = args.metric or "accuracy"

    def loss_shape(self) -> LossShape:
        """Cross-entropy or squared error of the first token, averaged over rows."""
        return LossShape(Averaging.row_mean)

    # ----------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ClassificationData:
        glue = glue_task(cfg.name)
        splits = data_lib.load_splits(cfg)
        train = splits["train"]
        text, pair, label = _columns(cfg, glue, train)
        values = train.examples[label]
        regression = self.args.problem_type == "regression" or (
            self.args.problem_type == "auto"
            and (glue.labels is None if glue else _looks_continuous(values))
        )
        label_names: list[str] | None = None  # None: regression
        if not regression and glue and glue.labels:
            label_names = list(glue.labels)
        elif not regression:
            label_names = sorted({str(v) for v in values})
        self.main_metric = self.args.metric or (
            glue.metric if glue else ("pearson" if regression else "accuracy")
        )
        log.info(
            "%s on columns text=%s%s label=%s; %s",
            f"GLUE {cfg.name}" if glue else "classification",
            text,
            f" pair={pair}" if pair else "",
            label,
            "regression" if label_names is None else f"{len(label_names)} labels {label_names}",
        )
        columns = (text, pair, label)
        features = {}
        for role, split in splits.items():
            _columns(cfg, glue, split)  # the same columns must exist in both splits
            build = functools.partial(
                self._map,
                split.examples,
                tokenizer,
                columns,
                label_names,
                f"{role} data {split.source}",
                f"{role} features",
                cfg.preprocessing_num_workers,
            )
            features[role] = data_lib.cached_features(
                cfg,
                "cls",
                role,
                split,
                tokenizer,
                build,
                columns=columns,
                labels=label_names,
                task=self.features_key(),
                version=FEATURES_VERSION,
            )
        return ClassificationData(
            train=features["train"],
            eval=features["eval"],
            max_length=self.args.max_seq_length,
            label_names=label_names,
        )

    def _map(
        self,
        examples: Dataset,
        tokenizer: PreTrainedTokenizerBase,
        columns: tuple[str, str | None, str | None],
        label_names: list[str] | None,
        source: str,
        desc: str,
        num_proc: int | None = None,
    ) -> Dataset:
        """``examples`` tokenized (:meth:`_features`), their labels as ids where ``columns``
        names a label column; ``source`` names the data in a refusal."""
        with data_lib.map_progress(len(examples)):
            return examples.map(
                self._features,
                batched=True,
                remove_columns=examples.column_names,
                fn_kwargs={
                    "tokenizer": tokenizer,
                    "columns": columns,
                    "label_names": label_names,
                    "source": source,
                },
                num_proc=num_proc,
                desc=desc,
            )

    def _features(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        columns: tuple[str, str | None, str | None],
        label_names: list[str] | None,
        source: str,
    ) -> dict[str, list]:
        text, pair, label = columns
        for column in (text, pair):
            if column is None:
                continue
            for n, value in enumerate(batch[column]):
                if not isinstance(value, str):
                    raise DataError(
                        f"{source}: column {column!r} of a row holds {value!r}, not text (row "
                        f"{n} of its batch); fix or drop that row."
                    )
        encoded = tokenizer(
            batch[text],
            batch[pair] if pair else None,
            truncation=True,
            max_length=self.args.max_seq_length,
        )
        if label is not None:  # None: rows to predict on
            encoded["labels"] = [_label_id(v, label_names, source, label) for v in batch[label]]
        return dict(encoded)

    def build_predict_data(
        self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase
    ) -> ClassificationData:
        """The texts of ``data.predict_file`` (the training columns; no label needed)."""
        split = data_lib.load_predict_file(cfg)
        text, pair, _ = _columns(cfg, glue_task(cfg.name), split, with_label=False)
        examples = split.examples
        source = f"predict data {split.source}"
        features = self._map(
            examples, tokenizer, (text, pair, None), None, source, "predict features"
        )
        return ClassificationData(
            train=features.select([]),
            eval=features,
            max_length=self.args.max_seq_length,
            row_ids=row_ids(examples),
        )

    def predict(
        self, model: torch.nn.Module, loader: Iterable, data: ClassificationData, run: RunContext
    ) -> dict[str, Any]:
        """``predictions.jsonl``: per row (in file order) its id, the predicted label and every
        label's probability; for regression, the predicted score. Label names are the model's
        own (``id2label``, saved by the training run)."""
        config = run.accelerator.unwrap_model(model).config
        regression = config.problem_type == "regression" or config.num_labels == 1

        def step(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict:
            logits = model(**batch).logits.float()
            return {"out": logits.squeeze(-1) if regression else logits.softmax(-1)}

        rows = gather_rows(step, model, loader, run.accelerator)
        if rows is None:
            return write_predictions(run, len(data.eval), None)
        values = rows["out"].numpy()
        names = [str(config.id2label[i]) for i in range(config.num_labels)]
        records = (
            {"id": row, "score": float(value)}
            if regression
            else {
                "id": row,
                "label": names[int(value.argmax())],
                "probabilities": dict(zip(names, value.tolist(), strict=True)),
            }
            for row, value in zip(data.row_ids or [], values, strict=True)
        )
        return write_predictions(run, len(data.eval), records)

    def model_kwargs(self, data: ClassificationData) -> dict[str, Any]:
        if data.label_names is None:
            return {"num_labels": 1, "problem_type": "regression"}
        return {
            "num_labels": len(data.label_names),
            "problem_type": "single_label_classification",
            "id2label": dict(enumerate(data.label_names)),
            "label2id": {name: i for i, name in enumerate(data.label_names)},
        }

    # ----------------------------------------------------------------------------- evaluation

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per row: the prediction (a label id, or a score where the labels are floats:
        regression), the label and the row's loss."""
        target = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        if target.is_floating_point():
            predicted = logits.squeeze(-1)
            loss = (predicted - target.float()) ** 2
        else:
            predicted = logits.argmax(-1)
            loss = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        return {"predicted": predicted, "labels": target, "loss": loss}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: ClassificationData, run: RunContext
    ) -> dict[str, float]:
        y_hat, y = rows["predicted"].numpy(), rows["labels"].numpy()
        if data.label_names is None:
            metrics = regression_scores(y_hat.astype(np.float64), y.astype(np.float64))
        else:
            metrics = classification_scores(y_hat, y.astype(np.int64), len(data.label_names))
        metrics["loss"] = float(rows["loss"].numpy().mean())
        return metrics


def _label_id(value: Any, label_names: list[str] | None, source: str, column: str) -> float | int:
    """The model's target for a label ``value``: a float (regression) or the label's id."""
    if label_names is None:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise DataError(
                f"{source}: label {value!r} in column {column!r} is not a number "
                "(regression); set task.problem_type=single_label_classification?"
            ) from None
    if isinstance(value, str) and value in label_names:
        return label_names.index(value)
    if str(value) in label_names:
        return label_names.index(str(value))
    if isinstance(value, (int, np.integer)) and 0 <= value < len(label_names):
        return int(value)
    raise DataError(
        f"{source}: label {value!r} in column {column!r} is not one of "
        f"{label_names} (nor an id below {len(label_names)}); unlabelled test "
        "data cannot be used for training or evaluation."
    )


def _columns(
    cfg: DataConfig, glue: GlueTask | None, split: data_lib.Split, with_label: bool = True
) -> tuple[str, str | None, str]:
    """The text, pair and label columns: explicit settings first, then the GLUE task's names,
    then ``text`` / ``label``. Without ``with_label`` (rows to predict on) the label is not
    looked for, and returned as ''."""
    pick = data_lib.pick_column
    text = pick(split, "text_column", cfg.text_column, glue.text if glue else ("text", "sentence"))
    pair = None
    if cfg.text_pair_column is not None or (glue and glue.pair is not None):
        pair = pick(split, "text_pair_column", cfg.text_pair_column, glue.pair if glue else ())
    label = ""
    if with_label:
        label = pick(split, "label_column", cfg.label_column, glue.label if glue else ("label",))
    return text, pair, label


def _looks_continuous(values: list) -> bool:
    """Float labels that are not all whole numbers are a regression target."""
    return any(isinstance(v, float) and not float(v).is_integer() for v in values[:10_000])
