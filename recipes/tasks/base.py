"""What a task gives the shared loop.

A task (``conf/task/*.yaml`` names its class) is a small object with:

* ``auto_model_class``: the ``transformers`` auto class of the model head it trains;
* ``main_metric`` and ``greater_is_better``: the evaluation number that ranks checkpoints;
* ``build_data(data_cfg, tokenizer) -> TaskData``: model-ready train / evaluation features;
* ``model_kwargs() -> dict``: extra ``from_pretrained`` arguments known only once the data is
  built (the number of labels of a classification task, say); ``check_model(model)`` refuses
  settings the loaded model cannot run;
* ``loss(model, batch) -> Tensor`` and ``evaluate(model, loader, accelerator, output_dir)``;
* ``after_training(model, tokenizer, accelerator, output_dir) -> dict``: optional last words
  (a generated sample for a language model).

:class:`Task` implements the parts most tasks share, so a task module only writes what is its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import PreTrainedTokenizerBase


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


class Task:
    """Defaults shared by the tasks; subclasses set ``auto_model_class`` and build data."""

    auto_model_class: Any = None
    main_metric = "loss"
    greater_is_better = False

    def build_data(self, cfg: Any, tokenizer: PreTrainedTokenizerBase) -> TaskData:
        raise NotImplementedError

    def model_kwargs(self) -> dict[str, Any]:
        return {}

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse settings the loaded model cannot run (raise ConfigError naming the key)."""

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model's own loss (the batch carries its labels)."""
        return model(**batch).loss

    def after_training(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        accelerator: Accelerator,
        output_dir: Path,
    ) -> dict[str, Any]:
        return {}


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=_to_builtin))
    tmp.replace(path)


def _to_builtin(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
