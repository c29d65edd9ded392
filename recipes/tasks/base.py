"""The contract between a task and the shared loop: fill in :class:`Task`, and nothing else.

A task (``conf/task/*.yaml`` names its class and holds its settings' defaults, the only place
they are written: the constructor takes them as required keywords) is one small subclass of
:class:`Task`. It must give:

* ``auto_model_class``: the ``transformers`` auto class of the model head it trains;
* ``build_data(data_cfg, tokenizer) -> TaskData``: model-ready train / evaluation features, plus
  whatever the task learnt from its data (label names, the windows answers are read from), in a
  :class:`TaskData` subclass of its own;
* ``evaluate(model, loader, data, accelerator, output_dir) -> dict``: the scores of the model.

and may change the defaults of ``main_metric`` / ``greater_is_better`` (the number that ranks
checkpoints; a task may settle ``main_metric`` in ``build_data``, as a GLUE task does),
``max_seq_length``, ``settings()``, ``model_kwargs(data)``, ``check_model(model)``,
``before_training(...)``, ``loss(model, batch)`` and ``after_training(...)``. The loop hands the data that ``build_data``
returned back to ``model_kwargs``, ``evaluate`` and ``after_training``: a task keeps no hidden state between them.
A task that answers new rows (``mode=predict``) also gives ``build_predict_data(data_cfg,
tokenizer)`` and ``predict(...)``, which get the same hand-back.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from recipes.config import ConfigError
from recipes.log import get_logger

if TYPE_CHECKING:
    from recipes.config import DataConfig, GenerationConfig

log = get_logger(__name__)


@dataclass
class TaskData:
    """Model-ready features and how to batch them.

    A collator of None pads each batch to its longest sequence (``DataCollatorWithPadding``).
    """

    train: Dataset
    eval: Dataset
    train_collator: Callable[[list[dict]], dict] | None = None
    eval_collator: Callable[[list[dict]], dict] | None = None
    # The train collator draws random numbers (MLM masking): the loop seeds it per batch.
    random_collator: bool = False
    # Token ids the task added to the tokenizer (a chat template's special tokens): the loop
    # gives them embedding rows and trains those rows, under LoRA too.
    new_tokens: list[int] = field(default_factory=list)
    # Tokens that end a generated answer besides EOS (a chat template's end of turn): saved as
    # the model's generation_config.eos_token_id, which serving stacks stop on.
    stop_tokens: list[int] = field(default_factory=list)


DataT = TypeVar("DataT", bound=TaskData)


@dataclass
class SummedLoss:
    """A micro-batch's loss as the sum of its terms (per-token losses) and their count.

    The loop divides the gradient of a whole optimizer step by the terms of that step on all
    processes, so every token weighs the same however they fall into micro-batches and ranks:
    the full-batch gradient, as transformers' Trainer and TRL get with ``num_items_in_batch``."""

    total: torch.Tensor
    count: torch.Tensor
    # The task's own sums over the same terms (DPO's rewards), named in Task.logged_stats: the
    # loop logs each as train/<name>, divided by the terms of the log window on all processes.
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(abc.ABC, Generic[DataT]):
    """What the loop asks of a task; ``DataT`` is the :class:`TaskData` its ``build_data``
    returns and its ``evaluate`` reads."""

    auto_model_class: Any  # e.g. AutoModelForQuestionAnswering; every task sets it
    main_metric: str = "loss"  # the evaluation score (without "eval/") that ranks checkpoints
    greater_is_better: bool = False
    # The length trainer.padding=max_length pads every batch to; None where the task has no
    # such length (packed language-model blocks all have one length already).
    max_seq_length: int | None = None
    # loss() is a mean of one value per row that padding does not change (classification; QA
    # with its padding-free softmax), so a batch's loss is its sub-batches' losses weighted by
    # rows (``trainer.sub_batches``).
    splits_exactly: bool = False
    # loss() returns a SummedLoss (the loop normalises the step's gradient by its terms).
    sums_loss_terms: bool = False
    # The names of SummedLoss.stats, logged as train/<name>.
    logged_stats: tuple[str, ...] = ()

    @property
    def terms_per_example(self) -> int:
        """About how many terms a training example adds to a SummedLoss at most: the loop
        divides each sum by this times the batch size before backward, so that gradients keep
        the size of a mean's (what the fp16 scaler expects), and corrects it exactly at the
        optimizer step. Labelled tokens by default; DPO's one term per pair says 1."""
        return self.max_seq_length or 1

    @abc.abstractmethod
    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> DataT:
        """Load, check and featurize the train and evaluation splits."""

    @abc.abstractmethod
    def evaluate(
        self,
        model: torch.nn.Module,
        loader: Iterable[dict[str, torch.Tensor]],
        data: DataT,
        accelerator: Accelerator,
        output_dir: Path | None,
    ) -> dict[str, float]:
        """Scores of ``model`` on ``loader`` (the batches of ``data.eval``), the same on every
        process; the loop logs them as ``eval/<name>``."""

    def settings(self) -> dict[str, Any]:
        """The task's settings that shape its features (part of their cache key)."""
        return dict(vars(self))

    def model_kwargs(self, data: DataT) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments learnt from the data (the number of labels)."""
        return {}

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse settings the loaded model cannot run (raise ConfigError naming the key)."""

    def loss(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | SummedLoss:
        """The model's own loss (the batch carries its labels): a mean, which the loop averages
        over micro-batches and processes; or a :class:`SummedLoss` where rows carry different
        numbers of loss terms (assistant tokens)."""
        return model(**batch).loss

    def before_training(
        self, model: torch.nn.Module, data: DataT, accelerator: Accelerator, batch_size: int
    ) -> None:
        """Work on the prepared model with the run's starting weights, before a resumed run
        loads its checkpoint (DPO's reference model); ``batch_size`` is the evaluation's."""

    def after_training(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        data: DataT,
        accelerator: Accelerator,
        output_dir: Path,
    ) -> dict[str, Any]:
        """Last words logged after training (a generated sample for a language model)."""
        return {}

    # ----------------------------------------------------------------------------- mode=predict

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> DataT:
        """mode=predict: the rows of ``data.predict_file`` (no labels needed) as model-ready
        features in ``eval`` (``train`` is empty), checked as training rows are, plus what
        :meth:`predict` needs to write its answers."""
        raise ConfigError(
            f"mode=predict: task={type(self).__name__} has no predictions to make; qa, "
            "classification, token_classification, multiple_choice, seq2seq, clm, sft and dpo models "
            "predict (mode=eval scores this one)."
        )

    def predict(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        loader: Iterable[dict[str, torch.Tensor]],
        data: DataT,
        accelerator: Accelerator,
        output_dir: Path,
        generation: GenerationConfig,
    ) -> dict[str, Any]:
        """mode=predict: answer every row of ``data`` (``loader`` batches ``data.eval``; the
        ``tokenizer`` is the one ``build_predict_data`` had), write the task's predictions file
        into ``output_dir`` (main process), and return what to report: ``rows`` and ``file``."""
        raise NotImplementedError


# A predict file's columns that name its rows (GLUE's test files have idx), kept in the output.
ID_COLUMNS = ("id", "idx", "index")


def row_ids(examples: Dataset, columns: Sequence[str] = ID_COLUMNS) -> list[Any]:
    """Each row's id, from the first of ``columns`` the rows have; a row without one (JSON lines
    may mix rows), or rows without such a column, are named by their number."""
    column = next((c for c in columns if c in examples.column_names), None)
    if column is None:
        return list(range(len(examples)))
    return [n if v is None else v for n, v in enumerate(examples[column])]


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=_to_builtin))
    tmp.replace(path)


def _to_builtin(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Write one JSON object per line, atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False, default=_to_builtin) + "\n")
    tmp.replace(path)
