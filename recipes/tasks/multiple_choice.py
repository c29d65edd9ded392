"""Multiple choice, SWAG-style (``task=multiple_choice``).

What the task adds to the shared loop: finding the context, header, choices and label of each
row in either of two layouts, building one text pair per choice as Hugging Face's run_swag does,
padding rows with fewer choices (their padding choices masked out of the loss and the argmax),
and scoring accuracy.

* **SWAG layout**: ``sent1`` (the context), ``sent2`` (the start of the sentence the choice
  completes), ``ending0``, ``ending1``, ... (any number, at least 2) and ``label`` (or
  ``labels``), the right ending's index.
* **Generic layout**: a ``choices`` list per row (``data.choices_column`` names another column),
  ``context`` and / or ``question``, and ``label``: the right choice's index or its text.

Each choice becomes the pair (context, f"{header} {choice}"), cut to ``task.max_seq_length``
tokens (the longer text first); with one text only (a question alone), (text, choice).
``data.text_column`` names the context column and ``data.text_pair_column`` the header's (the
question's); ``data.label_column`` the label's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForMultipleChoice, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes.config import DataConfig
from recipes.data import DataError
from recipes.evaluation import gather_rows
from recipes.log import get_logger
from recipes.tasks import outputs
from recipes.tasks.base import RunContext, Task, TaskData
from recipes.tasks.configs.multiple_choice import MultipleChoiceConfig

log = get_logger(__name__)

FEATURES_VERSION = 1
LABEL_COLUMNS = ("label", "labels")
CONTEXT_COLUMNS = ("context",)
QUESTION_COLUMNS = ("question",)
# A row's own id (SWAG's fold-ind; not its video-id, which many rows share), kept in the output.
ID_COLUMNS = (*outputs.ID_COLUMNS, "ind", "fold-ind")
# The loss and the argmax never pick a padding choice.
MASKED = float("-inf")


@dataclass(frozen=True)
class Layout:
    """Where a row's parts are: the context (first text) and header (put before each choice)
    columns, if any, the choice columns (SWAG's ending0..N) or the one list column, and the
    label column ('' when the rows have none: mode=predict)."""

    context: str | None
    header: str | None
    endings: tuple[str, ...]  # SWAG: one column per choice
    choices: str | None  # generic: one list column
    label: str

    def describe(self) -> str:
        parts = [f"context={self.context}"] if self.context else []
        parts += [f"header={self.header}"] if self.header else []
        parts.append(
            f"choices={self.choices}" if self.choices else f"endings={','.join(self.endings)}"
        )
        parts += [f"label={self.label}"] if self.label else []
        return " ".join(parts)


@dataclass
class ChoiceData(TaskData):
    """Features plus, for mode=predict, each row's id (an ID_COLUMNS value or its number) and
    its choices' texts."""

    row_ids: list[Any] | None = None
    choice_texts: list[list[str]] | None = None


class MultipleChoiceCollator:
    """Pads a batch of rows to its largest number of choices and its longest choice.

    A padding choice is ``[CLS] [SEP]`` (attention on those two tokens only, so every row of
    the model's input has something to attend to) and ``choice_mask`` marks it 0: the task's
    loss and argmax drop it. Tokens are padded to the batch's longest choice, rounded up to
    ``pad_to_multiple_of`` (set from trainer.pad_to_multiple_of by the loop), as transformers'
    DataCollatorForMultipleChoice pads; with ``padding="max_length"`` (trainer.padding), to at
    least ``max_length``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ends = tokenizer("")["input_ids"]  # the special tokens alone: [CLS] [SEP] for BERT
        self.empty = list(ends) or [self.pad_id]
        self.pad_to_multiple_of: int | None = None
        self.padding = "longest"
        self.max_length: int | None = None  # padding=max_length: every choice this long

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        choices = max(len(f["input_ids"]) for f in features)
        longest = max(len(ids) for f in features for ids in f["input_ids"])
        fixed = (self.max_length or 0) if self.padding == "max_length" else 0
        longest = max(longest, len(self.empty), fixed)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        rows = len(features)
        keys = ["input_ids", "attention_mask"]
        if "token_type_ids" in features[0]:
            keys.append("token_type_ids")
        batch = {
            "input_ids": torch.full((rows, choices, longest), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros((rows, choices, longest), dtype=torch.long),
            "choice_mask": torch.zeros((rows, choices), dtype=torch.long),
        }
        if "token_type_ids" in keys:
            batch["token_type_ids"] = torch.zeros((rows, choices, longest), dtype=torch.long)
        for r, feature in enumerate(features):
            n = len(feature["input_ids"])
            batch["choice_mask"][r, :n] = 1
            for c in range(choices):
                if c < n:
                    ids = feature["input_ids"][c]
                    batch["input_ids"][r, c, : len(ids)] = torch.tensor(ids)
                    batch["attention_mask"][r, c, : len(ids)] = torch.tensor(
                        feature["attention_mask"][c]
                    )
                    if "token_type_ids" in keys:
                        batch["token_type_ids"][r, c, : len(ids)] = torch.tensor(
                            feature["token_type_ids"][c]
                        )
                else:
                    batch["input_ids"][r, c, : len(self.empty)] = torch.tensor(self.empty)
                    batch["attention_mask"][r, c, : len(self.empty)] = 1
        if "labels" in features[0]:
            batch["labels"] = torch.tensor([int(f["labels"]) for f in features])
        return batch


def masked_logits(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's choice scores (float32), padding choices at -inf."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "choice_mask")}
    logits = model(**inputs).logits.float()
    mask = batch.get("choice_mask")
    if mask is not None:
        logits = logits.masked_fill(mask == 0, MASKED)
    return logits


class MultipleChoice(Task[ChoiceData]):
    """Pick the right one of several choices (``task=multiple_choice``).

    Args:
        max_seq_length: each (context, choice) pair is cut to this many tokens, the longer text
            first (run_swag's ``max_seq_length``, 128).
    """

    auto_model_class = AutoModelForMultipleChoice
    main_metric = "accuracy"
    greater_is_better = True
    args: MultipleChoiceConfig

    # loss_shape: the default mean. The cross-entropy over each row's own choices, averaged over
    # rows, would not change with padding, but the loop sorts rows into sub-batches
    # (trainer.sub_batches) by their features' length, which here is the number of choices,
    # not tokens: they would only run smaller batches and save no padding.

    def model_kwargs(self, data: ChoiceData) -> dict[str, Any]:
        # The multiple-choice head scores one choice at a time (one output): a checkpoint's
        # classifier of another shape (a 2-label GLUE head) is replaced by a new one, as any
        # missing head is. mode=eval / predict still refuse a model without this task's head.
        return {"ignore_mismatched_sizes": True}

    # ----------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ChoiceData:
        splits = data_lib.load_splits(cfg)
        layout = find_layout(cfg, splits["train"])
        log.info("multiple choice on columns %s", layout.describe())
        features = {}
        for role, split in splits.items():
            if role != "train":
                # The same columns must hold the same parts in the evaluation data.
                other = find_layout(cfg, split)
                if other != layout:
                    raise DataError(
                        f"{role} data {split.source}: its columns ({other.describe()}) are not "
                        f"the training data's ({layout.describe()}); give both splits one layout."
                    )
            build = functools.partial(
                self._map, split, tokenizer, layout, f"{role} data {split.source}", cfg
            )
            features[role] = data_lib.cached_features(
                cfg,
                "mc",
                role,
                split,
                tokenizer,
                build,
                layout=layout,
                task=self.features_key(),
                version=FEATURES_VERSION,
            )
        return self._data(features["train"], features["eval"], tokenizer)

    def _data(self, train: Dataset, evaluation: Dataset, tokenizer: Any, **kw: Any) -> ChoiceData:
        return ChoiceData(
            train=train,
            eval=evaluation,
            train_collator=MultipleChoiceCollator(tokenizer),
            eval_collator=MultipleChoiceCollator(tokenizer),
            max_length=self.args.max_seq_length,
            **kw,
        )

    def _map(
        self,
        split: data_lib.Split,
        tokenizer: PreTrainedTokenizerBase,
        layout: Layout,
        source: str,
        cfg: DataConfig | None = None,
    ) -> Dataset:
        with data_lib.map_progress(len(split.examples)):
            return split.examples.map(
                self._features,
                batched=True,
                with_indices=True,
                remove_columns=split.examples.column_names,
                fn_kwargs={"tokenizer": tokenizer, "layout": layout, "source": source},
                num_proc=cfg.preprocessing_num_workers if cfg else None,
                desc="multiple-choice features",
            )

    def _features(
        self,
        batch: Mapping[str, list],
        indices: list[int],
        tokenizer: PreTrainedTokenizerBase,
        layout: Layout,
        source: str,
    ) -> dict[str, list]:
        firsts: list[str] = []
        seconds: list[str] = []
        counts: list[int] = []
        labels: list[int] = []
        for i, index in enumerate(indices):
            context, header, choices, label = read_row(batch, i, index, layout, source)
            for choice in choices:
                firsts.append(context if context is not None else header or "")
                if context is not None and header is not None:
                    seconds.append(f"{header} {choice}")
                else:
                    seconds.append(choice)
            counts.append(len(choices))
            if label is not None:
                labels.append(label)
        encoded = tokenizer(
            firsts, seconds, truncation="longest_first", max_length=self.args.max_seq_length
        )
        out: dict[str, list] = {k: [] for k in encoded}
        start = 0
        for n in counts:
            for k, values in encoded.items():
                out[k].append(values[start : start + n])
            start += n
        out["length"] = [
            len(ids) * max(len(x) for x in ids) for ids in out["input_ids"]
        ]  # tokens once padded: for trainer.group_by_length
        if layout.label:
            out["labels"] = labels
        return out

    # ----------------------------------------------------------------------------- mode=predict

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> ChoiceData:
        """The rows of ``data.predict_file``, in the training layout (no label needed)."""
        split = data_lib.load_predict_file(cfg)
        layout = find_layout(cfg, split, with_label=False)
        examples = split.examples
        features = self._map(split, tokenizer, layout, f"predict data {split.source}")
        texts = [
            read_row(examples[i : i + 1], 0, i, layout, split.source)[2]
            for i in range(len(examples))
        ]
        return self._data(
            features.select([]),
            features,
            tokenizer,
            row_ids=outputs.row_ids(examples, ID_COLUMNS),
            choice_texts=texts,
        )

    def predict(
        self, model: torch.nn.Module, loader: Iterable[dict], data: ChoiceData, run: RunContext
    ) -> dict[str, Any]:
        """``predictions.jsonl``: per row (in file order) its id, the chosen choice's index
        (``label``) and text (``choice``), and every choice's probability (``probabilities``, in
        the row's order; padding choices are not in it)."""
        # A batch holds as many choices as its widest row: padded to the widest of all to stack.
        width = max((len(texts) for texts in data.choice_texts or []), default=0)

        def step(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict:
            probs = masked_logits(model, batch).softmax(-1)
            return {"probs": torch.nn.functional.pad(probs, (0, width - probs.shape[1]))}

        rows = gather_rows(step, model, loader, run.accelerator)
        if rows is None:
            return outputs.write_predictions(run, len(data.eval), None)
        records = []
        for row, texts, padded in zip(
            data.row_ids or [], data.choice_texts or [], rows["probs"].tolist(), strict=True
        ):
            probs = padded[: len(texts)]
            best = int(np.argmax(probs))
            records.append(
                {"id": row, "label": best, "choice": texts[best], "probabilities": probs}
            )
        return outputs.write_predictions(run, len(data.eval), records)

    # ----------------------------------------------------------------------------- training

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy over each row's own choices (padding choices at -inf), mean over rows."""
        return torch.nn.functional.cross_entropy(masked_logits(model, batch), batch["labels"])

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per row: the chosen choice, the right one and the row's cross-entropy."""
        logits = masked_logits(model, batch)
        target = batch["labels"]
        loss = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        return {"predicted": logits.argmax(-1), "labels": target, "loss": loss}

    def score(
        self, rows: Mapping[str, torch.Tensor], data: ChoiceData, run: RunContext
    ) -> dict[str, float]:
        y_hat, y = rows["predicted"].numpy(), rows["labels"].numpy()
        return {"accuracy": float((y_hat == y).mean()), "loss": float(rows["loss"].numpy().mean())}


# --------------------------------------------------------------------------------- layouts


def find_layout(cfg: DataConfig, split: data_lib.Split, with_label: bool = True) -> Layout:
    """The columns of ``split``'s rows: data.* names first, then the SWAG layout (ending0..N)
    or the generic one (a ``choices`` list). Missing columns are refused, naming them."""
    have = split.examples.column_names

    def named(key: str, value: str | None) -> str | None:
        if value is not None and value not in have:
            raise DataError(
                f"data.{key}={value}: no such column in {split.source} (it has {', '.join(have)})."
            )
        return value

    def first(candidates: Sequence[str]) -> str | None:
        return next((c for c in candidates if c in have), None)

    choices = named("choices_column", cfg.choices_column)
    endings: tuple[str, ...] = ()
    if choices is None:
        n = 0
        while f"ending{n}" in have:
            n += 1
        endings = tuple(f"ending{i}" for i in range(n))
        if not endings:
            choices = first(("choices",))
        if not endings and choices is None:
            raise DataError(
                f"{split.source}: no choices found: give SWAG's ending0, ending1, ... columns "
                f"or a list column called choices (or name it with data.choices_column=...); "
                f"it has {', '.join(have)}."
            )
        if endings and len(endings) < 2:
            raise DataError(
                f"{split.source}: column ending1 is missing (it has {', '.join(have)}); a "
                "multiple-choice row needs at least 2 choices."
            )
    context = named("text_column", cfg.text_column)
    header = named("text_pair_column", cfg.text_pair_column)
    if endings:  # SWAG: sent1 and sent2 are required
        for key, value, default in (
            ("text_column", context, "sent1"),
            ("text_pair_column", header, "sent2"),
        ):
            if value is None and default not in have:
                raise DataError(
                    f"{split.source}: SWAG layout (ending0..{len(endings) - 1}) without column "
                    f"{default!r} (it has {', '.join(have)}); name the column with "
                    f"data.{key}=..."
                )
        context = context or "sent1"
        header = header or "sent2"
    else:
        context = context or first(CONTEXT_COLUMNS)
        header = header or first(QUESTION_COLUMNS)
        if context is None and header is None:
            raise DataError(
                f"{split.source}: no question or context column (it has {', '.join(have)}); "
                "name it with data.text_column=... (the context) and / or "
                "data.text_pair_column=... (the question, put before each choice)."
            )
    label = ""
    if with_label:
        label = named("label_column", cfg.label_column) or first(LABEL_COLUMNS) or ""
        if not label:
            raise DataError(
                f"{split.source}: no label column (label or labels; it has "
                f"{', '.join(have)}); name it with data.label_column=... Unlabelled rows "
                "can only be predicted on (mode=predict data.predict_file=...)."
            )
    return Layout(context, header, endings, choices, label)


def read_row(
    batch: Mapping[str, list], i: int, index: int, layout: Layout, source: str
) -> tuple[str | None, str | None, list[str], int | None]:
    """(context, header, choices, label index) of row ``i`` of ``batch`` (row ``index`` of the
    data, counted from 1 in messages), checked: text where text belongs, at least 2 choices,
    none empty, a label that is an index below the number of choices or one choice's text."""
    where = f"{source}: row {index + 1}"

    def text(column: str, allow_empty: bool = True) -> str:
        value = batch[column][i]
        if value is None:  # the row has no such key (JSON lines) or holds null there
            what = "choice" if not allow_empty else "text"
            raise DataError(
                f"{where}, field {column!r}: the {what} is missing (no value, or null); fix or "
                "drop that row."
            )
        if not isinstance(value, str):
            raise DataError(
                f"{where}, field {column!r}: holds {value!r} ({type(value).__name__}), not "
                "text; fix or drop that row."
            )
        if not allow_empty and not value.strip():
            raise DataError(
                f"{where}, field {column!r}: the choice is empty; fix or drop that row."
            )
        return value

    context = text(layout.context) if layout.context else None
    header = text(layout.header) if layout.header else None
    if layout.choices:
        values = batch[layout.choices][i]
        if not isinstance(values, (list, tuple)):
            raise DataError(
                f"{where}, field {layout.choices!r}: holds {values!r}, not a list of choices; "
                "fix or drop that row."
            )
        choices = []
        for n, value in enumerate(values):
            if value is None:
                raise DataError(
                    f"{where}, field {layout.choices!r}[{n}]: the choice is missing (null); fix "
                    "or drop that row."
                )
            if not isinstance(value, str):
                raise DataError(
                    f"{where}, field {layout.choices!r}[{n}]: holds {value!r} "
                    f"({type(value).__name__}), not text; fix or drop that row."
                )
            if not value.strip():
                raise DataError(
                    f"{where}, field {layout.choices!r}[{n}]: the choice is empty; fix or drop "
                    "that row."
                )
            choices.append(value)
        if len(choices) < 2:
            raise DataError(
                f"{where}, field {layout.choices!r}: {len(choices)} choice(s); a row needs at "
                "least 2."
            )
    else:
        choices = [text(column, allow_empty=False) for column in layout.endings]
    label = None
    if layout.label:
        label = label_index(batch[layout.label][i], choices, f"{where}, field {layout.label!r}")
    return context, header, choices, label


def label_index(value: Any, choices: list[str], where: str) -> int:
    """The right choice's index: ``value`` is the index (a whole number, or its digits as text)
    or the choice's own text."""
    if isinstance(value, str):
        if value in choices:
            return choices.index(value)
        if value.strip().isdigit():
            value = int(value)
        else:
            raise DataError(
                f"{where}: label {value!r} is not one of the row's {len(choices)} choices (nor "
                "an index); fix or drop that row."
            )
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if 0 <= value < len(choices):
            return int(value)
        raise DataError(
            f"{where}: label {value} is out of range for the row's {len(choices)} choices "
            f"(0 to {len(choices) - 1}); fix or drop that row."
        )
    raise DataError(
        f"{where}: label {value!r} is neither a choice's index nor its text; unlabelled rows "
        "can only be predicted on (mode=predict)."
    )
