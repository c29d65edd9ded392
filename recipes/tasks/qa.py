"""Extractive question answering (SQuAD v1.1 and v2.0).

What the task adds to the shared loop: reading and checking SQuAD data, turning questions and
contexts into windowed features with labels, and turning the model's logits back into answers and
EM / F1. Everything else (devices, precision, batching, logging, saving) is the loop's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from datasets import Dataset
from transformers import AutoModelForQuestionAnswering, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes.config import ConfigError, DataConfig
from recipes.data import DataError
from recipes.log import get_logger
from recipes.metrics.squad import squad_v1, squad_v2
from recipes.tasks.base import Task, TaskData, write_json
from recipes.tasks.qa_answers import AnswerCollector, top_candidates

log = get_logger(__name__)

FEATURES_VERSION = 1  # bump when feature building changes, to invalidate cached features
COLUMNS = ("id", "context", "question", "answers")
MAX_REPORTED_PROBLEMS = 5


def read_squad_json(path: Path) -> Dataset | None:
    """Flatten an official nested SQuAD JSON file (v1.1 or v2.0) into one row per question.

    Returns None when the file is not in that layout (so the generic JSON reader takes it).
    The rows have the columns of the hub's ``squad`` / ``squad_v2`` data sets; unanswerable
    v2.0 questions get empty answer lists (their ``plausible_answers`` are not answers).
    """
    if path.suffix != ".json":
        return None
    with path.open(encoding="utf-8") as handle:
        try:
            raw = json.load(handle)
        except json.JSONDecodeError:
            return None  # JSON lines, or broken: let the generic reader report it
    if not (isinstance(raw, dict) and isinstance(raw.get("data"), list)):
        return None
    rows: dict[str, list[Any]] = {
        "id": [],
        "title": [],
        "context": [],
        "question": [],
        "answers": [],
    }
    for a, article in enumerate(raw["data"]):
        for p, paragraph in enumerate(article.get("paragraphs", [])):
            if "context" not in paragraph or "qas" not in paragraph:
                raise DataError(
                    f"{path}: data[{a}].paragraphs[{p}] lacks 'context' or 'qas'; "
                    "is this an official SQuAD file?"
                )
            for q, qa in enumerate(paragraph["qas"]):
                missing = [key for key in ("id", "question", "answers") if key not in qa]
                if missing:
                    raise DataError(
                        f"{path}: data[{a}].paragraphs[{p}].qas[{q}] (id {qa.get('id', '?')}) "
                        f"lacks {', '.join(missing)}."
                    )
                answers = [] if qa.get("is_impossible") else qa["answers"]
                rows["id"].append(str(qa["id"]))
                rows["title"].append(article.get("title", ""))
                rows["context"].append(paragraph["context"])
                rows["question"].append(qa["question"])
                rows["answers"].append(
                    {
                        "text": [answer["text"] for answer in answers],
                        "answer_start": [int(answer["answer_start"]) for answer in answers],
                    }
                )
    return Dataset.from_dict(rows)


def check_examples(dataset: Dataset, source: str, allow_unanswerable: bool) -> None:
    """Refuse data whose labels are broken, naming the question and the field.

    Training on an answer whose ``answer_start`` does not point at its text silently teaches the
    model wrong spans, so every offset is checked once, before any feature is built.
    """
    missing = [c for c in COLUMNS if c not in dataset.column_names]
    if missing:
        raise DataError(
            f"{source}: missing column(s) {', '.join(missing)} (has "
            f"{', '.join(dataset.column_names)}); SQuAD data needs {', '.join(COLUMNS)}."
        )
    if len(dataset) == 0:
        raise DataError(f"{source}: holds no questions.")
    problems: list[str] = []
    for row in dataset.select_columns(list(COLUMNS)):
        qid, context, answers = row["id"], row["context"], row["answers"]
        if not context or not context.strip():
            problems.append(f"id {qid}: empty context")
        if not row["question"] or not row["question"].strip():
            problems.append(f"id {qid}: empty question")
        texts, starts = answers.get("text", []), answers.get("answer_start", [])
        if len(texts) != len(starts):
            problems.append(f"id {qid}: {len(texts)} answer texts but {len(starts)} answer_start")
            continue
        if not texts and not allow_unanswerable:
            problems.append(
                f"id {qid}: no answer (SQuAD v2.0 data? use recipe=bert_squad_v2 or "
                "task.version_2_with_negative=true)"
            )
        for n, (text, start) in enumerate(zip(texts, starts, strict=True)):
            found = context[start : start + len(text)] if start >= 0 else None
            if found != text:
                problems.append(
                    f"id {qid}: answers.answer_start[{n}]={start} points at {found!r}, "
                    f"not at the answer text {text!r}"
                )
    if problems:
        shown = "; ".join(problems[:MAX_REPORTED_PROBLEMS])
        more = len(problems) - MAX_REPORTED_PROBLEMS
        raise DataError(
            f"{source}: {len(problems)} broken example(s): {shown}"
            + (f"; and {more} more" if more > 0 else "")
            + ". Fix the file or remove those questions."
        )


@dataclass
class QAData(TaskData):
    """Features plus what evaluation needs to turn logits back into answers."""

    eval_examples: Dataset | None = None
    eval_windows: Dataset | None = None  # offsets and example index per evaluation window


class QuestionAnswering(Task):
    """SQuAD-style extractive QA: features, loss and evaluation (``task=qa``).

    Args:
        max_seq_length: tokens per window (question + context + special tokens).
        doc_stride: tokens shared by consecutive windows of a long context.
        max_query_length: questions are cut to this many tokens.
        n_best_size: start / end candidates per window.
        max_answer_length: longest answer, in tokens.
        version_2_with_negative: SQuAD v2.0, where a question may have no answer.
        null_score_diff_threshold: v2: answer "" when null score - best span score exceeds this.
        write_nbest: write ``nbest_predictions.json`` (every question's n_best candidates with
            probabilities) beside ``predictions.json`` at each evaluation.
    """

    auto_model_class = AutoModelForQuestionAnswering
    main_metric = "f1"
    greater_is_better = True

    def __init__(
        self,
        max_seq_length: int = 384,
        doc_stride: int = 128,
        max_query_length: int = 64,
        n_best_size: int = 20,
        max_answer_length: int = 30,
        version_2_with_negative: bool = False,
        null_score_diff_threshold: float = 0.0,
        write_nbest: bool = True,
    ) -> None:
        if doc_stride >= max_seq_length:
            raise ConfigError(
                f"task.doc_stride={doc_stride} must be smaller than task.max_seq_length="
                f"{max_seq_length} (windows would not advance); the reference uses 128 and 384."
            )
        if max_query_length >= max_seq_length - doc_stride:
            raise ConfigError(
                f"task.max_query_length={max_query_length} leaves no room for context in a "
                f"{max_seq_length}-token window with doc_stride {doc_stride}; lower it."
            )
        for name, value in (
            ("max_seq_length", max_seq_length),
            ("n_best_size", n_best_size),
            ("max_answer_length", max_answer_length),
            ("doc_stride", doc_stride),
        ):
            if value < 1:
                raise ConfigError(f"task.{name}={value}: must be at least 1.")
        self.max_seq_length = max_seq_length
        self.doc_stride = doc_stride
        self.max_query_length = max_query_length
        self.n_best_size = n_best_size
        self.max_answer_length = max_answer_length
        self.version_2_with_negative = version_2_with_negative
        self.null_score_diff_threshold = null_score_diff_threshold
        self.write_nbest = write_nbest
        self.data: QAData | None = None
        self.left_padded = False

    # ----------------------------------------------------------------------------- data

    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("data", "left_padded")}

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> QAData:
        """Load, check and featurize the train and evaluation splits (cached on disk)."""
        if not tokenizer.is_fast:
            raise ConfigError(
                "model.name_or_path: question answering needs a fast tokenizer (offset mappings); "
                "this model only has a slow one."
            )
        self.left_padded = tokenizer.padding_side == "left"
        splits = data_lib.load_splits(cfg, reader=read_squad_json)
        for role, split in splits.items():
            check_examples(
                split.examples, f"{role} data {split.source}", self.version_2_with_negative
            )

        tokenizer_hash = data_lib.tokenizer_fingerprint(tokenizer)
        root = data_lib.cache_root(cfg)

        def key(role: str) -> str:
            return data_lib.cache_key(
                role=role,
                data=splits[role].fingerprint,
                tokenizer=tokenizer_hash,
                task=self.settings(),
                version=FEATURES_VERSION,
            )

        train_examples, eval_examples = splits["train"].examples, splits["eval"].examples
        num_proc = cfg.preprocessing_num_workers
        train = data_lib.cached(
            root / f"qa-train-{key('train')}",
            lambda: train_examples.map(
                self._train_features,
                batched=True,
                remove_columns=train_examples.column_names,
                fn_kwargs={"tokenizer": tokenizer},
                num_proc=num_proc,
                desc="train features",
            ),
        )
        windows = data_lib.cached(
            root / f"qa-eval-{key('eval')}",
            lambda: eval_examples.map(
                self._eval_features,
                batched=True,
                with_indices=True,
                remove_columns=eval_examples.column_names,
                fn_kwargs={"tokenizer": tokenizer},
                num_proc=num_proc,
                desc="eval features",
            ),
        )
        if len(train) == 0:
            raise DataError("train data: no features could be built (all contexts empty?).")
        model_inputs = [c for c in tokenizer.model_input_names if c in windows.column_names]
        # Longest windows first: batches of similar lengths carry little padding, which makes
        # evaluation about twice as fast as file order on a CPU. Answers are collected by
        # feature_index, so the order changes no score; the longest batch comes first, so an
        # out-of-memory shows at once.
        by_length = np.argsort(-data_lib.feature_lengths(windows), kind="stable")
        eval_inputs = (
            windows.select_columns(model_inputs)
            .add_column("feature_index", list(range(len(windows))))
            .select(by_length, keep_in_memory=True)  # an index map in memory, no cache file
        )
        log.info(
            "train: %d questions -> %d features; eval: %d questions -> %d features",
            len(train_examples),
            len(train),
            len(eval_examples),
            len(windows),
        )
        self.data = QAData(
            train=train,
            eval=eval_inputs,
            eval_examples=eval_examples,
            eval_windows=windows.select_columns(["offset_mapping", "example_index"]),
        )
        return self.data

    def _tokenize(self, examples: Mapping[str, list], tokenizer: PreTrainedTokenizerBase):
        questions = [q.lstrip() for q in examples["question"]]
        # Cut overlong questions at a token boundary, as BERT's original SQuAD code does, so that
        # a rambling question cannot squeeze the context out of the window.
        cut = tokenizer(
            questions,
            add_special_tokens=False,
            truncation=True,
            max_length=self.max_query_length,
            return_offsets_mapping=True,
        )
        questions = [
            q[: offs[-1][1]] if offs else q
            for q, offs in zip(questions, cut["offset_mapping"], strict=True)
        ]
        pad_right = not self.left_padded
        first, second = (
            (questions, examples["context"]) if pad_right else (examples["context"], questions)
        )
        encoded = tokenizer(
            first,
            second,
            truncation="only_second" if pad_right else "only_first",
            max_length=self.max_seq_length,
            stride=self.doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding=False,
        )
        return encoded, 1 if pad_right else 0

    def _train_features(self, examples: Mapping[str, list], tokenizer: PreTrainedTokenizerBase):
        encoded, context_id = self._tokenize(examples, tokenizer)
        sample_map = encoded.pop("overflow_to_sample_mapping")
        offsets_all = encoded.pop("offset_mapping")
        starts, ends = [], []
        for i, offsets in enumerate(offsets_all):
            cls_index = (
                encoded["input_ids"][i].index(tokenizer.cls_token_id)
                if tokenizer.cls_token_id in encoded["input_ids"][i]
                else 0
            )
            answers = examples["answers"][sample_map[i]]
            sequence_ids = encoded.sequence_ids(i)
            context = [k for k, s in enumerate(sequence_ids) if s == context_id]
            if not answers["answer_start"] or not context:
                starts.append(cls_index)
                ends.append(cls_index)
                continue
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            first, last = context[0], context[-1]
            if offsets[first][0] > start_char or offsets[last][1] < end_char:
                # The answer is not (wholly) inside this window: label it "no answer here".
                starts.append(cls_index)
                ends.append(cls_index)
                continue
            token_start = first
            while token_start <= last and offsets[token_start][0] <= start_char:
                token_start += 1
            token_end = last
            while token_end >= first and offsets[token_end][1] >= end_char:
                token_end -= 1
            starts.append(token_start - 1)
            ends.append(token_end + 1)
        encoded["start_positions"] = starts
        encoded["end_positions"] = ends
        return encoded

    def _eval_features(
        self, examples: Mapping[str, list], indices: list[int], tokenizer: PreTrainedTokenizerBase
    ):
        encoded, context_id = self._tokenize(examples, tokenizer)
        sample_map = encoded.pop("overflow_to_sample_mapping")
        encoded["example_index"] = [indices[s] for s in sample_map]
        encoded["offset_mapping"] = [
            [
                list(o) if s == context_id else [-1, -1]
                for o, s in zip(offsets, encoded.sequence_ids(i), strict=True)
            ]
            for i, offsets in enumerate(encoded["offset_mapping"])
        ]
        return encoded

    # ----------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(
        self, model: torch.nn.Module, loader: Any, accelerator: Accelerator, output_dir: Path | None
    ) -> dict[str, float]:
        """Answer every evaluation question, score EM / F1, write the predictions files.

        Every process runs its share of the windows; only the top candidates of each window are
        gathered, and the main process turns them into answers batch by batch.
        """
        assert self.data is not None, "build_data() first"
        collector = None
        if accelerator.is_main_process:
            collector = AnswerCollector(
                self.data.eval_windows, self.n_best_size, self.max_answer_length
            )
        model.eval()
        for batch in loader:
            feature_index = batch.pop("feature_index")
            outputs = model(**batch)
            candidates = top_candidates(
                outputs.start_logits,
                outputs.end_logits,
                batch["attention_mask"],
                self.n_best_size,
                self.left_padded,
            )
            candidates["feature_index"] = feature_index
            candidates = accelerator.gather_for_metrics(candidates)
            if collector is not None:
                arrays = {k: v.cpu().numpy() for k, v in candidates.items()}
                collector.add(arrays, arrays.pop("feature_index"))
        model.train()
        metrics: dict[str, float] = {}
        if collector is not None:
            metrics = self._score(collector, output_dir)
        return broadcast_object_list([metrics])[0]

    def _score(self, collector: AnswerCollector, output_dir: Path | None) -> dict[str, float]:
        assert self.data is not None
        examples = self.data.eval_examples
        with_nbest = self.write_nbest and output_dir is not None
        predictions, nbest, null_odds = collector.answers(
            examples, self.version_2_with_negative, self.null_score_diff_threshold, with_nbest
        )
        references = {
            qid: answers["text"]
            for qid, answers in zip(examples["id"], examples["answers"], strict=True)
        }
        if self.version_2_with_negative:
            # The main numbers score the predictions as made; null_odds only feed the search
            # for the best threshold (best_f1_thresh is in null_score_diff_threshold's units).
            scores = squad_v2(
                predictions, references, no_answer_probs=null_odds, no_answer_threshold=float("inf")
            )
        else:
            scores = squad_v1(predictions, references)
        if output_dir is not None:
            write_json(output_dir / "predictions.json", predictions)
            if with_nbest:
                write_json(output_dir / "nbest_predictions.json", nbest)
            if null_odds:
                write_json(output_dir / "null_odds.json", null_odds)
        return {k: float(v) for k, v in scores.items() if k != "total"}
