"""Token classification: named-entity recognition as run_ner does it (``task=token_classification``).

What the task adds to the shared loop: reading sentences of words and tags (CoNLL column files,
the ``datasets`` layout of ``tokens`` + ``ner_tags``, JSON lines), checking every tag, giving
word labels to sub-words, windowing long sentences, and scoring entities with seqeval.

Scores are over words: each word's prediction is its first sub-word's, whatever
``label_all_tokens`` trains on. (run_ner scores every labelled sub-word, so its numbers with
``--label_all_tokens`` count a long word's entity tags several times.)
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import ClassLabel, Dataset
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    DataCollatorForTokenClassification,
    PreTrainedTokenizerBase,
)

from recipes import data as data_lib
from recipes.config import ConfigError, DataConfig
from recipes.data import DataError
from recipes.evaluation import gather_rows
from recipes.log import get_logger
from recipes.tasks.base import (
    IGNORE_INDEX,
    Averaging,
    Batches,
    LossShape,
    Report,
    RunContext,
    SummedLoss,
    Task,
    TaskData,
)
from recipes.tasks.configs.token_classification import (
    SCHEME_PREFIXES,
    TokenClassificationConfig,
    prefix_error,
)
from recipes.tasks.outputs import row_ids, write_predictions

log = get_logger(__name__)

FEATURES_VERSION = 1
TOKEN_COLUMNS = ("tokens", "words")
TAG_COLUMNS = ("ner_tags", "tags", "labels")
# Words of a raw ``text`` to predict on: @mentions, #tags and words (with inner ' - .), and each
# other non-space character alone, close to how WNUT-17 and CoNLL-2003 split their sentences.
WORD = re.compile(r"[@#]?\w+(?:['’.\-]\w+)*|[^\w\s]")


@dataclass
class NerData(TaskData):
    """Features plus what turns the model's per-position output back into words: for every
    feature its sentence (``feature_rows``) and the words its labelled positions stand for
    (``feature_words``), in position order."""

    label_names: list[str] = field(default_factory=list)
    words: list[list[str]] = field(default_factory=list)  # the evaluated / predicted sentences
    tags: list[list[str]] = field(default_factory=list)  # their gold tags (evaluation)
    feature_rows: list[int] = field(default_factory=list)
    feature_words: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # mode=predict: each row's text
    offsets: list[list[tuple[int, int]]] = field(default_factory=list)  # each word's characters
    row_ids: list[Any] = field(default_factory=list)


class TokenClassification(Task[NerData]):
    """Tag every word of a sentence (``task=token_classification``; settings in
    :class:`TokenClassificationConfig`)."""

    auto_model_class = AutoModelForTokenClassification
    args: TokenClassificationConfig
    main_metric = "f1"
    greater_is_better = True
    # The entities predictions.jsonl lists follow the scheme the model was trained with.
    final_settings = ("scheme",)

    def loss_shape(self) -> LossShape:
        """Summed cross-entropy of the labelled sub-words and their count: the loop divides by
        the whole optimizer step's count on all processes, so every labelled sub-word weighs the
        same however they fall into micro-batches and processes (transformers' loss is a mean
        per micro-batch, which weighs a sub-word by 1/its batch's count). A feature labels at
        most ``max_seq_length`` sub-words."""
        return LossShape(
            Averaging.sum, terms_per_example=self.args.max_seq_length, splits_by_row=True
        )

    @property
    def scheme(self) -> str | None:
        return self.args.strict_scheme

    # ----------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> NerData:
        _check_tokenizer(tokenizer)
        splits = data_lib.load_splits(cfg, read_columns)
        tokens_column, tags_column = columns(cfg, splits["train"])
        label_names = self._model_order(self._label_names(splits["train"], tags_column), tokenizer)
        log.info(
            "token classification on columns tokens=%s tags=%s; %d labels %s",
            tokens_column,
            tags_column,
            len(label_names),
            label_names,
        )
        built: dict[str, tuple[Dataset, dict]] = {}
        for role, split in splits.items():
            tokens_column, tags_column = columns(cfg, split)
            words, tags = sentences(split, tokens_column, tags_column, label_names, self.scheme)
            built[role] = self._featurize(cfg, role, split, tokenizer, words, tags, label_names)
            if role == "eval":
                built[role][1]["words"] = words
                built[role][1]["tags"] = [[label_names[t] for t in row] for row in tags]
        (train, _), (evaluation, info) = built["train"], built["eval"]
        return NerData(
            train=train,
            eval=evaluation,
            train_collator=self._collator(tokenizer),
            eval_collator=self._collator(tokenizer),
            max_length=self.args.max_seq_length,
            label_names=label_names,
            **info,
        )

    def _collator(self, tokenizer: PreTrainedTokenizerBase) -> DataCollatorForTokenClassification:
        # Pads labels with -100 (the loop sets pad_to_multiple_of, padding and max_length from
        # trainer.*).
        return DataCollatorForTokenClassification(tokenizer, label_pad_token_id=IGNORE_INDEX)

    def _model_order(self, names: list[str], tokenizer: PreTrainedTokenizerBase) -> list[str]:
        """The model's own labels, in its order, where they hold every label of the data (a
        run's final/ scored with mode=eval on data where a rare type is missing, or trained
        further), as run_ner reuses a model's ``label2id``: its head's rows stay the labels they
        were trained for. A task.label_list that differs from them is refused: the scores would
        be silently wrong."""
        try:
            config = AutoConfig.from_pretrained(tokenizer.name_or_path)
        except (OSError, ValueError):
            return names
        saved = [str(config.id2label[i]) for i in range(config.num_labels)]
        if not set(names) <= set(saved) or saved == names:
            return names
        if self.args.label_list is not None:
            raise ConfigError(
                f"task.label_list={names}: the model {tokenizer.name_or_path} was trained "
                f"with the labels {saved} (in that order); give them so, or leave "
                "task.label_list=null to use them."
            )
        log.info("labels in the model's own order: %s", saved)
        return saved

    def _label_names(self, split: data_lib.Split, tags_column: str) -> list[str]:
        """task.label_list, else the data set's ClassLabel names, else the sorted set of the
        training tags (run_ner's order) with their partners (:func:`partners`)."""
        if self.args.label_list is not None:
            return list(self.args.label_list)
        feature = split.examples.features[tags_column]
        inner = getattr(feature, "feature", None)
        if isinstance(inner, ClassLabel):
            return list(inner.names)
        values: set = set()
        for row in split.examples[tags_column]:
            values.update(row or [])
        if any(not isinstance(v, str) for v in values):
            raise DataError(
                f"{split.source}: column {tags_column!r} holds tag ids, and the data names no "
                "labels (no ClassLabel feature); give the names in id order with "
                "task.label_list=[O,B-PER,I-PER,...]."
            )
        return sorted(values | partners(values, self.scheme))

    def _featurize(
        self,
        cfg: DataConfig,
        role: str,
        split: data_lib.Split,
        tokenizer: PreTrainedTokenizerBase,
        words: list[list[str]],
        tags: list[list[int]],
        label_names: list[str],
    ) -> tuple[Dataset, dict]:
        all_tokens = self.args.label_all_tokens and role == "train"
        b_to_i = inside_labels(label_names) if all_tokens else None

        def build() -> Dataset:
            rows = Dataset.from_dict({"tokens": words, "tags": tags, "row": range(len(words))})
            with data_lib.map_progress(len(rows)):
                return rows.map(
                    self._features,
                    batched=True,
                    remove_columns=rows.column_names,
                    fn_kwargs={"tokenizer": tokenizer, "b_to_i": b_to_i},
                    num_proc=cfg.preprocessing_num_workers,
                    desc=f"{role} features",
                )

        features = data_lib.cached_features(
            cfg,
            "ner",
            role,
            split,
            tokenizer,
            build,
            labels=label_names,
            length=self.args.max_seq_length,
            long=self.args.long_sentences,
            stride=self.args.stride,
            all_tokens=all_tokens,
            version=FEATURES_VERSION,
        )
        return self._split_off(features, role, len(words))

    def _split_off(self, features: Dataset, role: str, sentences: int) -> tuple[Dataset, dict]:
        """The model's columns, and the bookkeeping ones as lists (plus the long-sentence
        warning, which counts them)."""
        rows, dropped = list(features["row"]), list(features["dropped"])
        windowed = len(rows) - len(set(rows))
        cut = sum(1 for d in dropped if d)
        if self.args.long_sentences == "window" and windowed:
            log.warning(
                "%d of %d %s sentences are longer than task.max_seq_length=%d sub-words: split "
                "into overlapping windows (task.stride=%d), each word trained and scored once",
                len({r for r, n in zip(rows, _repeats(rows), strict=True) if n > 1}),
                sentences,
                role,
                self.args.max_seq_length,
                self.args.stride,
            )
        if cut:
            log.warning(
                "%d of %d %s sentences lose %d words: %s",
                cut,
                sentences,
                role,
                sum(dropped),
                "past task.max_seq_length (task.long_sentences=truncate): not trained on, "
                "and scored as O"
                if self.args.long_sentences == "truncate"
                else "the tokenizer gives them no sub-word: scored as O",
            )
        info = {"feature_rows": rows, "feature_words": list(features["owned"])}
        return features.remove_columns(["row", "owned", "dropped"]), info

    def _features(
        self,
        batch: Mapping[str, list],
        tokenizer: PreTrainedTokenizerBase,
        b_to_i: list[int] | None,
    ) -> dict[str, list]:
        words = batch["tokens"]
        if _prefix_space(tokenizer):
            words = [[" " + w for w in row] for row in words]
        encoded = tokenizer(words, is_split_into_words=True)
        out: dict[str, list] = {k: [] for k in (*encoded.keys(), "labels", "row", "owned")}
        out["dropped"] = []
        for i, row in enumerate(batch["row"]):
            word_ids = encoded.word_ids(i)
            slide = self.args.long_sentences == "window"
            for window in windows(
                word_ids, self.args.max_seq_length, self.args.stride, slide, len(batch["tokens"][i])
            ):
                for k in encoded:
                    out[k].append([encoded[k][i][p] for p in window.positions])
                labels, owned = window_labels(window, word_ids, batch["tags"][i], b_to_i)
                out["labels"].append(labels)
                out["owned"].append(owned)
                out["row"].append(row)
                out["dropped"].append(window.dropped)
        return out

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> NerData:
        """The sentences of ``data.predict_file``: a tokens column (a list of words), or raw
        ``text`` (data.text_column) that is split into words here."""
        _check_tokenizer(tokenizer)
        split = data_lib.load_predict_file(cfg, read_columns)
        examples = split.examples
        have = examples.column_names
        found = (
            [cfg.text_column]
            if cfg.text_column
            else [c for c in (*TOKEN_COLUMNS, "text", "sentence") if c in have]
        )
        if not found or found[0] not in have:
            raise DataError(
                f"{split.source}: no column of words or text (looked for "
                f"{', '.join((*TOKEN_COLUMNS, 'text', 'sentence'))}; it has {', '.join(have)}); "
                "name it with data.text_column=..."
            )
        # Per row, the first of those columns that it fills (JSON lines may mix words and text).
        values = [
            next((v for v in row if v is not None), None)
            for row in zip(*(examples[c] for c in found), strict=True)
        ]
        column = "/".join(found)
        words, texts, offsets = [], [], []
        for n, value in enumerate(values):
            if isinstance(value, str):
                matches = list(WORD.finditer(value))
                words.append([m.group() for m in matches])
                offsets.append([(m.start(), m.end()) for m in matches])
                texts.append(value)
            elif isinstance(value, list) and all(isinstance(w, str) for w in value):
                words.append(list(value))
                texts.append(" ".join(value))
                starts = np.cumsum([0] + [len(w) + 1 for w in value[:-1]]).tolist()
                offsets.append([(s, s + len(w)) for s, w in zip(starts, value, strict=True)])
            else:
                raise DataError(
                    f"{split.source} row {n + 1}: column {column!r} holds {value!r}, neither "
                    "text nor a list of words; fix or drop that row."
                )
        rows = Dataset.from_dict(
            {"tokens": words, "tags": [[0] * len(w) for w in words], "row": range(len(words))}
        )
        features = rows.map(
            self._features,
            batched=True,
            remove_columns=rows.column_names,
            fn_kwargs={"tokenizer": tokenizer, "b_to_i": None},
            desc="predict features",
        )
        features, info = self._split_off(features, "predict", len(words))
        return NerData(
            train=features.select([]),
            eval=features,
            eval_collator=self._collator(tokenizer),
            max_length=self.args.max_seq_length,
            words=words,
            texts=texts,
            offsets=offsets,
            row_ids=row_ids(examples),
            **info,
        )

    def model_kwargs(self, data: NerData) -> dict[str, Any]:
        if not data.label_names:  # mode=predict: the model's own labels
            return {}
        # A checkpoint's classifier of another shape (a 2-label GLUE head) is replaced by a new
        # one, as a missing head is; mode=eval / predict still refuse such a model (load_model).
        return {
            "ignore_mismatched_sizes": True,
            "num_labels": len(data.label_names),
            "id2label": dict(enumerate(data.label_names)),
            "label2id": {name: i for i, name in enumerate(data.label_names)},
        }

    # ----------------------------------------------------------------------------- training

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> SummedLoss:
        labels = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        # ignore_index rather than boolean indexing, whose output size the host would have to
        # read from the device (a sync every step).
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return SummedLoss(nll, (labels != IGNORE_INDEX).sum().float())

    # ----------------------------------------------------------------------------- evaluation

    def eval_step(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Per feature: the predicted label id and its probability at each labelled position,
        moved to the front in position order and padded with -100 / 0 to ``max_seq_length``
        (at most a feature's labelled positions), so rows of every batch stack; and the summed
        cross-entropy of the labelled positions and their count."""
        labels = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        labelled = labels != IGNORE_INDEX
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels.clamp(min=0), reduction="none"
        )
        prob, best = logits.softmax(-1).max(-1)
        width = self.args.max_seq_length
        first = torch.argsort((~labelled).int(), dim=1, stable=True)[:, :width]
        kept = labelled.gather(1, first)
        pad = (0, width - kept.shape[1])
        return {
            "best": torch.nn.functional.pad(
                best.gather(1, first).masked_fill(~kept, IGNORE_INDEX), pad, value=IGNORE_INDEX
            ),
            "prob": torch.nn.functional.pad(prob.gather(1, first) * kept, pad),
            "nll": (nll * labelled).sum(1).double(),
            "count": labelled.sum(1).double(),
        }

    def score(
        self, rows: Mapping[str, torch.Tensor], data: NerData, run: RunContext
    ) -> dict[str, float]:
        """seqeval's scores of each word's predicted tag (predicted O where no window scores
        it), and the mean cross-entropy of the labelled positions."""
        predicted, _ = _word_outputs(rows, data)
        names = data.label_names
        tags = [[names[i] if i >= 0 else "O" for i in row] for row in predicted]
        metrics = ner_scores(data.tags, tags, self.scheme)
        nll, count = rows["nll"].sum(), rows["count"].sum()
        metrics["loss"] = float(nll / count) if count else 0.0
        return metrics

    def predict(self, model: nn.Module, loader: Batches, data: NerData, run: RunContext) -> Report:
        """``predictions.jsonl``: per row (in file order) its id, words, each word's tag and
        the entities: type, words, text, character start / end (in the row's text; words given
        as a list are joined by single spaces) and score, the mean over the entity's words of
        the probability of each word's predicted tag. Tag names are the model's (id2label)."""
        rows = gather_rows(self.eval_step, model, loader, run.accelerator)
        if rows is None:
            return write_predictions(run, len(data.row_ids), None)
        predicted, scores = _word_outputs(rows, data)
        config = run.accelerator.unwrap_model(model).config
        names = [str(config.id2label[i]) for i in range(config.num_labels)]
        records = []
        for n, row_id in enumerate(data.row_ids):
            tags = [names[i] if i >= 0 else "O" for i in predicted[n]]
            found = entities(tags, self.scheme)
            records.append(
                {
                    "id": row_id,
                    "words": data.words[n],
                    "tags": tags,
                    "entities": [
                        _entity(kind, start, end, data, n, scores[n]) for kind, start, end in found
                    ],
                }
            )
        return write_predictions(run, len(data.row_ids), records)


def _word_outputs(
    rows: Mapping[str, torch.Tensor], data: NerData
) -> tuple[list[list[int]], list[list[float]]]:
    """Per sentence of ``data``, from every feature's :meth:`TokenClassification.eval_step`
    rows: each word's predicted label id and its probability (-1 and 0 for a word no window
    scores)."""
    words = [[-1] * len(w) for w in data.words]
    scores = [[0.0] * len(w) for w in data.words]
    for f, (best, prob) in enumerate(zip(rows["best"], rows["prob"], strict=True)):
        keep, row = best != IGNORE_INDEX, data.feature_rows[f]
        labels, probs = best[keep].tolist(), prob[keep].tolist()
        for w, label, p in zip(data.feature_words[f], labels, probs, strict=True):
            words[row][w], scores[row][w] = label, p
    return words, scores


def _entity(kind: str, start: int, end: int, data: NerData, row: int, scores: list[float]) -> dict:
    first, last = data.offsets[row][start][0], data.offsets[row][end - 1][1]
    return {
        "type": kind,
        "words": data.words[row][start:end],
        "word_start": start,
        "word_end": end,
        "text": data.texts[row][first:last],
        "start": first,
        "end": last,
        "score": float(np.mean(scores[start:end])),
    }


def _repeats(rows: list[int]) -> list[int]:
    counts: dict[int, int] = {}
    for r in rows:
        counts[r] = counts.get(r, 0) + 1
    return [counts[r] for r in rows]


# --------------------------------------------------------------------------------- reading


def read_columns(path: Path) -> Dataset | None:
    """The task's reader (recipes.data.Reader): a CoNLL column file of any suffix but JSON /
    parquet / CSV (.conll is always read so), as rows of tokens and ner_tags."""
    if path.suffix == ".conll" or data_lib.looks_like_conll(path):
        return data_lib.read_conll(path)
    return None


def columns(cfg: DataConfig, split: data_lib.Split) -> tuple[str, str]:
    """The words and tags columns: data.text_column / data.label_column, else tokens / words
    and ner_tags / tags / labels, else the one column ending in _tags (as run_ner's
    ``<task>_tags``)."""
    tags = [c for c in split.examples.column_names if c.endswith("_tags")]
    words = data_lib.pick_column(split, "text_column", cfg.text_column, TOKEN_COLUMNS)
    return words, data_lib.pick_column(split, "label_column", cfg.label_column, TAG_COLUMNS, tags)


def sentences(
    split: data_lib.Split,
    tokens_column: str,
    tags_column: str,
    label_names: list[str],
    scheme: str | None,
) -> tuple[list[list[str]], list[list[int]]]:
    """Every row's words and tag ids, checked: words are text, as many tags as words, each tag
    a label name (or an id below their count), and, with a strict scheme, tags that follow it.
    A bad row is refused naming the file and its line (CoNLL) or row, and the field."""
    examples = split.examples
    lines = examples["line"] if "line" in examples.column_names else None
    ids = {name: i for i, name in enumerate(label_names)}
    # Tag ids of a ClassLabel feature name the split's own labels, whose order can differ from
    # label_names (a model's order, the other split's): read as names first.
    inner = getattr(examples.features[tags_column], "feature", None)
    own = list(inner.names) if isinstance(inner, ClassLabel) else None
    words_out, tags_out = [], []
    for n, (words, tags) in enumerate(
        zip(examples[tokens_column], examples[tags_column], strict=True)
    ):
        where = functools.partial(_where, split.source, lines, n)

        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise DataError(
                f"{where()}: column {tokens_column!r} holds {words!r}, not a list of words."
            )
        if not isinstance(tags, list) or len(tags) != len(words):
            count = len(tags) if isinstance(tags, list) else "no list of"
            raise DataError(
                f"{where()}: {len(words)} words in column {tokens_column!r} but {count} tags "
                f"in column {tags_column!r}; give each word one tag."
            )
        row = []
        for i, tag in enumerate(tags):
            if own is not None and isinstance(tag, (int, np.integer)) and 0 <= tag < len(own):
                tag = own[tag]
            if isinstance(tag, str) and tag in ids:
                row.append(ids[tag])
            elif (
                isinstance(tag, (int, np.integer))
                and not isinstance(tag, bool)
                and (0 <= tag < len(label_names))
            ):
                row.append(int(tag))
            else:
                raise DataError(
                    f"{where(i)}: tag {tag!r} (column {tags_column!r}, word {words[i]!r}) is not "
                    f"one of the labels {label_names}; the labels come from the training data (or task.label_list): fix the "
                    "tag, or add it there."
                )
        if scheme is not None:
            bad = scheme_error([label_names[t] for t in row], scheme)
            if bad is not None:
                i, why = bad
                raise DataError(
                    f"{where(i)}: tag {label_names[row[i]]!r} (column {tags_column!r}, word "
                    f"{words[i]!r}) {why} under task.scheme={scheme}; fix the tag, or use "
                    "task.scheme=null (seqeval's lenient reading)."
                )
        words_out.append(list(words))
        tags_out.append(row)
    return words_out, tags_out


def partners(tags: set[str], scheme: str | None) -> set[str]:
    """The tags a type seen in training can also take, missing from the training tags: with B-X
    seen, I-X (and the other way round); with a strict scheme, each of its prefixes. So a
    training slice where I-product never occurs still reads an evaluation split that has it;
    a type never seen in training stays unknown."""
    prefixes = SCHEME_PREFIXES[scheme][0] if scheme else "BI"
    kinds = {t[2:] for t in tags if len(t) > 2 and t[1] == "-" and t[0] in prefixes}
    return {f"{p}-{k}" for p in prefixes for k in kinds} - tags


def _where(source: str, lines: list[int] | None, n: int, i: int | None = None) -> str:
    """Row ``n`` (word ``i``) of a split, for a message: its file line in a CoNLL file (the
    sentence's first line plus the word's place), else its row number and word."""
    if lines is not None:
        return f"{source} line {lines[n] + (i or 0)}"
    return f"{source} row {n + 1}" + (f", word {i + 1}" if i is not None else "")


def scheme_error(tags: Sequence[str], scheme: str) -> tuple[int, str] | None:
    """The first tag of a sentence that breaks ``scheme``, and why; None if all follow it."""
    allowed, continuing = SCHEME_PREFIXES[scheme]
    previous = "O"
    for i, tag in enumerate(tags):
        if prefix_error(tag, scheme):
            return i, f"is not O nor {'/'.join(allowed)}-<type>"
        prefix, _, kind = tag.partition("-")
        if prefix in continuing:
            p_prefix, _, p_kind = previous.partition("-")
            if p_kind != kind or p_prefix not in ("B", "I"):
                return i, "does not continue an entity of its type (after " + repr(previous) + ")"
        previous = tag
    return None


def _prefix_space(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether words must get a leading space: a byte-level BPE tokenizer (GPT-2, RoBERTa)
    loaded without add_prefix_space reads each word as if it began the text (``Hello`` where
    the model saw `` Hello``); run_ner loads those with add_prefix_space=True, which this
    matches."""
    if getattr(tokenizer, "add_prefix_space", None) is not False:
        return False
    try:
        plain, spaced = (
            tokenizer([w], is_split_into_words=True, add_special_tokens=False)["input_ids"]
            for w in ("a", " a")
        )
    except AssertionError:
        # transformers 4.x refuses words from a byte-level tokenizer loaded without
        # add_prefix_space; its flag only guards that check (the backend's pre-tokenizer keeps
        # its own setting), so the words get their leading space here, as on 5.x.
        tokenizer.add_prefix_space = True
        return True
    return plain != spaced


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.is_fast:
        raise ConfigError(
            f"model.name_or_path: its tokenizer ({type(tokenizer).__name__}) is not a fast "
            "tokenizer, which token classification needs to map sub-words to words (as "
            "run_ner); use a model with a tokenizer.json."
        )


# --------------------------------------------------------------------------------- windows


@dataclass
class Window:
    """One feature's positions in a sentence's encoding (its special tokens included) and the
    words it scores: ``owned`` words have their first sub-word here, and here they have the
    most context of all windows. ``dropped``: words of the sentence no window scores (set on
    the first window)."""

    positions: list[int]
    owned: set[int]
    dropped: int = 0


def windows(
    word_ids: Sequence[int | None], max_length: int, stride: int, slide: bool, words: int
) -> list[Window]:
    """The features of one encoded sentence of ``words`` words: itself if it fits in
    ``max_length``, else windows of its sub-words between its special tokens (``stride`` shared
    by consecutive windows), or the first window alone without ``slide``. Every word whose first
    sub-word some window holds is owned by exactly one window: the one where that sub-word is
    farthest from an edge (the first on a tie)."""
    content = [p for p, w in enumerate(word_ids) if w is not None]
    first = content[0] if content else len(word_ids)
    head = [p for p in range(first) if word_ids[p] is None]
    tail = [p for p in range(first, len(word_ids)) if word_ids[p] is None]
    room = max(1, max_length - len(head) - len(tail))
    starts = [0]
    while slide and starts[-1] + room < len(content):
        starts.append(starts[-1] + max(1, room - stride))
    spans = [(s, min(s + room, len(content))) for s in starts]
    out = [Window(positions=head + content[s:e] + tail, owned=set()) for s, e in spans]
    for at, p in enumerate(content):
        word = word_ids[p]
        if p > 0 and word_ids[p - 1] == word:
            continue  # not the word's first sub-word
        fits = [(min(at - s, e - 1 - at), -k) for k, (s, e) in enumerate(spans) if s <= at < e]
        if fits:
            out[-max(fits)[1]].owned.add(word)
    out[0].dropped = words - sum(len(w.owned) for w in out)
    return out


def window_labels(
    window: Window,
    word_ids: Sequence[int | None],
    tags: Sequence[int],
    b_to_i: list[int] | None,
) -> tuple[list[int], list[int]]:
    """The window's labels (its owned words' tags on their first sub-word, -100 elsewhere; with
    ``b_to_i``, label_all_tokens: on their later sub-words in the window too, B-X as I-X) and
    the word each labelled first sub-word stands for, in order."""
    labels, owned = [], []
    for p in window.positions:
        word = word_ids[p]
        if word is None or word not in window.owned:
            labels.append(IGNORE_INDEX)
        elif p == 0 or word_ids[p - 1] != word:
            labels.append(tags[word])
            owned.append(word)
        elif b_to_i is not None:
            labels.append(b_to_i[tags[word]])
        else:
            labels.append(IGNORE_INDEX)
    return labels, owned


def inside_labels(label_names: list[str]) -> list[int]:
    """For each label id, the label of a word's later sub-words under label_all_tokens: I-X for
    B-X where I-X exists (run_ner's b_to_i_label), else the label itself."""
    ids = {name: i for i, name in enumerate(label_names)}
    return [
        ids.get("I-" + name[2:], i) if name.startswith("B-") else i
        for i, name in enumerate(label_names)
    ]


# --------------------------------------------------------------------------------- scores


def ner_scores(
    y_true: list[list[str]], y_pred: list[list[str]], scheme: str | None
) -> dict[str, float]:
    """seqeval's micro precision / recall / F1 of entities, token accuracy, and F1 per entity
    type (``f1_<type>``): lenient (conlleval) without ``scheme``, strict with it."""
    from seqeval import metrics as seqeval
    from seqeval import scheme as schemes

    kwargs: dict[str, Any] = {"zero_division": 0}
    if scheme is not None:
        kwargs.update(mode="strict", scheme=getattr(schemes, scheme))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "seems not to be NE tag" for tags such as O-less sets
        scores = {
            "precision": float(seqeval.precision_score(y_true, y_pred, **kwargs)),
            "recall": float(seqeval.recall_score(y_true, y_pred, **kwargs)),
            "f1": float(seqeval.f1_score(y_true, y_pred, **kwargs)),
            "accuracy": float(seqeval.accuracy_score(y_true, y_pred)),
        }
        report = seqeval.classification_report(y_true, y_pred, output_dict=True, **kwargs)
    for kind, row in report.items():
        if not kind.endswith(" avg"):
            scores[f"f1_{kind}"] = float(row["f1-score"])
    return scores


def entities(tags: list[str], scheme: str | None) -> list[tuple[str, int, int]]:
    """The entities of one sentence's tags as (type, first word, end word), read as the metric
    reads them (seqeval's lenient chunks, or the strict scheme's)."""
    from seqeval import scheme as schemes
    from seqeval.metrics.sequence_labeling import get_entities

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if scheme is None:
            return [(kind, start, end + 1) for kind, start, end in get_entities(tags)]
        found = schemes.Entities([tags], getattr(schemes, scheme)).entities[0]
        return [(e.tag, e.start, e.end) for e in found]
