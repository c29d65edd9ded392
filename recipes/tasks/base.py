"""The contract between a task and the shared loop: fill in :class:`Task`, and nothing else.

A task is one small subclass of :class:`Task` and a typed config of its settings (a dataclass
in :mod:`recipes.tasks.configs`, whose fields hold their defaults, and whose ``RANGES`` and
``check`` refuse bad values before anything is built). The loop builds it as
``TaskClass(config)``; the task reads its settings from ``self.args``.

What a task must give:

* ``auto_model_class``: the ``transformers`` auto class of the model head it trains;
* ``build_data(data_cfg, tokenizer) -> TaskData``: model-ready train / evaluation features, how
  to batch and draw them (:class:`TaskData`), and whatever the task learnt from its data (label
  names, the windows answers are read from) in a :class:`TaskData` subclass of its own;
* its evaluation, one of two ways:

  - per batch (most tasks): ``eval_step(model, batch) -> {name: tensor}``, one row per example,
    and ``score(rows, data, run) -> metrics``. The loop switches the model to eval mode, runs
    ``eval_step`` under ``torch.no_grad``, gathers the rows of every process (without the
    duplicates that pad the last batch), calls ``score`` on the main process with the
    concatenated rows, and gives every process its metrics;
  - whole (tasks that evaluate by generating, or whose rows do not stack): ``evaluate(model,
    loader, data, run) -> metrics``, returned on the main process at least. The loop still
    owns the eval / train mode switch, no_grad and the broadcast.

What a task may change:

* ``main_metric`` / ``greater_is_better``: the number that ranks checkpoints (a task may settle
  ``main_metric`` in ``build_data``, as a GLUE task does); ``tie_metric`` /
  ``tie_greater_is_better``: the one that decides between evaluations whose main metric ties
  (the evaluation loss by default; a full tie goes to the latest evaluation);
* ``final_settings``: the task settings that ``mode=predict`` takes from ``final/`` (the
  training run's values) unless the command line names them;
* ``loss(model, batch)`` and ``loss_shape()``: the model's own mean loss by default; a mean of
  per-row values (which a batch split by rows keeps), or a :class:`SummedLoss` whose terms the
  loop weighs across the optimizer step (:class:`LossShape`);
* ``model_kwargs(data)``, ``check_model(model)``, ``before_training(model, data, run)``,
  ``after_training(model, data, run)``;
* ``build_predict_data(data_cfg, tokenizer)`` and ``predict(model, loader, data, run)`` for
  ``mode=predict``.

The loop hands the data that ``build_data`` returned back to every later call, and a
:class:`RunContext` (the accelerator, tokenizer, run folder and ``generation.*``) to the calls
that need the run: a task keeps no hidden state between them. The one exception is declared:
the parts a task builds in ``before_training`` for training itself (a reference policy, a rollout
buffer) live in attributes of their own and are checkpointed through ``before_training``'s
``run.accelerator.register_for_checkpointing``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import torch
from accelerate import Accelerator
from datasets import Dataset
from torch import nn
from transformers import PreTrainedTokenizerBase

from recipes.config import ConfigError
from recipes.gathering import gather_rows
from recipes.log import get_logger
from recipes.tasks.configs import TaskConfig

if TYPE_CHECKING:
    from recipes.config import DataConfig, GenerationConfig

log = get_logger(__name__)

IGNORE_INDEX = -100  # label of positions that carry no loss (transformers' convention)


class Seeding(str, Enum):
    """How the training collator's random choices are seeded (see :class:`TaskData`).

    none: the collator draws nothing. batch: it draws (MLM masking); the loop wraps it so each
    batch's draws come from the run's seed, the epoch and the batch's content. row: it draws per
    row from (seed, epoch, row) itself (:class:`SeedsRows`: sampled completions)."""

    none = "none"
    batch = "batch"
    row = "row"


@runtime_checkable
class SeedsRows(Protocol):
    """A training collator of ``Seeding.row``: the loop tells it the run's seed and the epoch
    before each epoch."""

    def start_epoch(self, seed: int, epoch: int) -> None: ...


@runtime_checkable
class PadsToMultiple(Protocol):
    """A task's own collator that pads: the loop sets ``trainer.pad_to_multiple_of`` on it, as
    on transformers' collators (same attribute name)."""

    pad_to_multiple_of: int | None


@runtime_checkable
class PadsToLength(Protocol):
    """A task's own collator that can pad to one length: with ``trainer.padding=max_length`` the
    loop sets ``padding="max_length"`` and ``max_length`` (transformers' names)."""

    padding: Any
    max_length: int | None


@dataclass
class Layout:
    """How a task's batches are laid out: padded rows, or (``flat``) each batch as one row of
    its sequences without padding (padding-free). The task's collators hold it from
    ``build_data`` on; the loop decides it once, when the model is loaded
    (:meth:`Task.flat_batches`), and never again."""

    flat: bool = False
    decided: bool = False

    def decide(self, flat: bool) -> None:
        """Settle the layout; a second decision must agree with the first (the collators and
        any reference table were built for it)."""
        if self.decided and flat != self.flat:
            raise RuntimeError(f"the batch layout was decided as flat={self.flat} already")
        self.flat, self.decided = flat, True


@dataclass
class TaskData:
    """Model-ready features and how the loop batches and draws them.

    A collator of None pads each batch to its longest sequence (``DataCollatorWithPadding``).
    """

    train: Dataset
    eval: Dataset
    train_collator: Callable[[list[dict]], dict] | None = None
    eval_collator: Callable[[list[dict]], dict] | None = None
    seeding: Seeding = Seeding.none
    # Each global batch is trained on for this many optimizer steps in a row (the sampler
    # repeats its rows; GRPO's num_iterations): the run's steps count every repeat.
    repeat_steps: int = 1
    # The length every batch is padded to with trainer.padding=max_length; None where the
    # features have no such length (packed blocks all have one length already).
    max_length: int | None = None
    # Token ids the task added to the tokenizer (a chat template's special tokens): the loop
    # gives them embedding rows and trains those rows, under LoRA too.
    new_tokens: list[int] = field(default_factory=list)
    # Tokens that end a generated answer besides EOS (a chat template's end of turn): saved as
    # the model's generation_config.eos_token_id, which serving stacks stop on.
    stop_tokens: list[int] = field(default_factory=list)
    # The chat template the model learns to answer in (saved with its tokenizer): final/ of such
    # a model is checked the way vLLM serves it.
    template: str | None = None
    # How the batches are laid out (padded or padding-free), shared with the task's collators
    # and decided once by the loop when the model is loaded (:meth:`Task.flat_batches`).
    layout: Layout = field(default_factory=Layout)


DataT = TypeVar("DataT", bound=TaskData)
# What an evaluation or predict loader yields, what an evaluation returns (name: value), and
# what a predict run reports (``rows``, ``file``).
Batches = Iterable[Mapping[str, torch.Tensor]]
Metrics = dict[str, float]
Report = dict[str, Any]


@dataclass
class SummedLoss:
    """A micro-batch's loss as the sum of its terms (per-token losses) and their count.

    The loop divides the gradient of a whole optimizer step by the terms of that step on all
    processes, so every token weighs the same however they fall into micro-batches and ranks:
    the full-batch gradient, as transformers' Trainer and TRL get with ``num_items_in_batch``."""

    total: torch.Tensor
    count: torch.Tensor
    # The task's own sums over the same terms (DPO's rewards), named in LossShape.stats: the
    # loop logs each as train/<name>, divided by the terms of the log window on all processes.
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


class Averaging(str, Enum):
    """What ``Task.loss`` returns, and so how the loop averages it.

    mean: a mean the loop averages over micro-batches and processes (the model's own loss).
    row_mean: a mean of one value per row that padding does not change (classification; QA
    with its padding-free softmax): ``trainer.sub_batches`` may split a batch by rows and
    weigh the pieces by their rows. sum: a :class:`SummedLoss`; the loop divides the step's
    gradient by the terms of the whole step on all processes."""

    mean = "mean"
    row_mean = "row_mean"
    sum = "sum"


@dataclass(frozen=True)
class LossShape:
    """How a task's loss averages, what it logs beside it, and its size."""

    averaging: Averaging = Averaging.mean
    # sum: about how many terms a training example adds at most. The loop divides each sum by
    # this times the batch size before backward, so gradients keep the size of a mean's (what
    # the fp16 scaler expects), and corrects it exactly at the optimizer step.
    terms_per_example: int = 1
    # sum: the names of SummedLoss.stats, logged as train/<name>.
    stats: tuple[str, ...] = ()
    # sum: each row's terms depend on that row alone (token classification; not KTO, whose KL
    # pairs rows of a micro-batch), so trainer.sub_batches may split a batch by rows, as it
    # may a row_mean.
    splits_by_row: bool = False

    @property
    def splits_exactly(self) -> bool:
        """Whether a micro-batch may run as sub-batches of its rows with the same gradient."""
        return self.averaging == Averaging.row_mean or (
            self.averaging == Averaging.sum and self.splits_by_row
        )


@dataclass
class RunContext:
    """What a task's run-time calls get from the run: the accelerator, the tokenizer the data
    was built with, the run folder (None where nothing may be written), ``generation.*`` and
    the log window (``trainer.log_every_n_steps``: a task's warnings come once per window)."""

    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    output_dir: Path | None
    generation: GenerationConfig
    log_every_n_steps: int = 1
    # trainer.per_device_train_batch_size in a training run; None where nothing trains.
    train_batch_size: int | None = None


class Task(abc.ABC, Generic[DataT]):
    """What the loop asks of a task; ``DataT`` is the :class:`TaskData` its ``build_data``
    returns and its other calls read."""

    auto_model_class: Any  # e.g. AutoModelForQuestionAnswering; every task sets it
    main_metric: str = "loss"  # the evaluation score (without "eval/") that ranks checkpoints
    greater_is_better: bool = False
    # Breaks a tie of main_metric (BLEU at 0 for a whole short run, accuracy on a small dev set);
    # when it ties too, the later evaluation wins.
    tie_metric: str = "loss"
    tie_greater_is_better: bool = False
    # Task settings (field names of ``args``) that change what predict writes and that the
    # training run saved in final/recipe.json: predict reads them from there.
    final_settings: tuple[str, ...] = ()
    # Its settings, a dataclass of recipes.tasks.configs whose _target_ names the task; each
    # task narrows the annotation to its own config class.
    args: TaskConfig
    # The attributes its before_training builds for training itself (a reference policy, a
    # rollout buffer, a teacher): the only ones a task sets after __init__.
    parts: tuple[str, ...] = ()
    # mode=predict's part, where the task answers a predict file the way another task does
    # (the chat tasks' PromptAnswers); a task without one overrides the predict calls itself.
    predictor: Predictor | None = None
    # Where evaluates_against_start: what the model is scored against, what would all be 0 were
    # that the model itself (mode=eval of a final/), and the setting that names another.
    start_reference: tuple[str, str, str | None] = (
        "its reference model",
        "every reward and KL",
        None,
    )

    def __init__(self, args: TaskConfig) -> None:
        self.args = args

    @abc.abstractmethod
    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> DataT:
        """Load, check and featurize the train and evaluation splits."""

    @property
    def language_model(self) -> bool:
        """Whether it trains a language model (causal or sequence to sequence), which can
        generate (answers after training, predictions, sampling) and be benchmarked by lm-eval."""
        return self.auto_model_class.__name__ in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM")

    def loss_shape(self) -> LossShape:
        """How :meth:`loss` averages (:class:`LossShape`): the model's own mean by default."""
        return LossShape()

    def features_key(self) -> dict[str, Any]:
        """The settings that shape the features (part of their cache key): the config's fields
        marked ``features=True``."""
        return self.args.features_key()

    # ------------------------------------------------------------------------------ evaluation

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """One evaluation batch's outputs, one row per example (first dimension), as tensors
        the loop gathers across processes; rows of one name must stack across batches."""
        raise NotImplementedError(f"{type(self).__name__} gives neither eval_step nor evaluate")

    def score(
        self, rows: Mapping[str, torch.Tensor], data: DataT, run: RunContext
    ) -> dict[str, float]:
        """The scores from every evaluation example's :meth:`eval_step` rows (main process)."""
        raise NotImplementedError(f"{type(self).__name__} gives eval_step but not score")

    def evaluate(self, model: nn.Module, loader: Batches, data: DataT, run: RunContext) -> Metrics:
        """Scores of ``model`` on ``loader`` (the batches of ``data.eval``), on the main process
        at least; the loop logs them as ``eval/<name>``. By default :meth:`eval_step` per batch,
        gathered, then :meth:`score`; a task that evaluates whole overrides this."""
        rows = gather_rows(self.eval_step, model, loader, run.accelerator)
        return self.score(rows, data, run) if rows is not None else {}

    # ------------------------------------------------------------------------ model and phases

    def model_kwargs(self, data: DataT) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments learnt from the data (the number of labels)."""
        return {}

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse settings the loaded model cannot run (raise ConfigError naming the key)."""

    def flat_batches(self, model: torch.nn.Module) -> bool:
        """Whether the batches run padding-free on ``model`` (its attention); the loop decides
        :attr:`TaskData.layout` with it once, after :meth:`check_model`. Padded by default."""
        return False

    @property
    def evaluates_against_start(self) -> bool:
        """Whether its evaluation compares the model with the weights it started from (DPO's
        rewards and margins, KTO's KL, GKD's divergence from the starting weights): mode=eval
        then needs the training run (``resume``), or it would score a model against itself."""
        return False

    def loss(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | SummedLoss:
        """The model's own loss (the batch carries its labels); see :meth:`loss_shape`."""
        return model(**batch).loss

    def before_training(
        self, model: torch.nn.Module, data: DataT, run: RunContext, batch_size: int
    ) -> None:
        """Work on the prepared model with the run's starting weights, before a resumed run
        loads its checkpoint (DPO's reference model); ``batch_size`` is the evaluation's."""

    def after_training(
        self, model: torch.nn.Module, data: DataT, run: RunContext
    ) -> dict[str, Any]:
        """Last words logged after training (a generated sample for a language model)."""
        return {}

    # ----------------------------------------------------------------------------- mode=predict

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> DataT:
        """mode=predict: the rows of ``data.predict_file`` (no labels needed) as model-ready
        features in ``eval`` (``train`` is empty), checked as training rows are, plus what
        :meth:`predict` needs to write its answers."""
        if self.predictor is None:
            raise ConfigError(
                f"mode=predict: task={type(self).__name__} has no predictions to make (mode=eval "
                "scores its model)."
            )
        return self.predictor.build_predict_data(cfg, tokenizer)

    def predict(self, model: nn.Module, loader: Batches, data: DataT, run: RunContext) -> Report:
        """mode=predict: answer every row of ``data`` (``loader`` batches ``data.eval``), write
        the task's predictions file into ``run.output_dir`` (main process), and return what to
        report: ``rows`` and ``file``."""
        if self.predictor is None:
            raise NotImplementedError
        return self.predictor.predict(model, loader, data, run)


class Predictor(Protocol):
    """mode=predict as a part a task holds (:attr:`Task.predictor`)."""

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Any: ...

    def predict(self, model: nn.Module, loader: Batches, data: Any, run: RunContext) -> Report: ...
