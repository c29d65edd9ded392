"""Extractive question answering (SQuAD v1.1 and v2.0).

What the task adds to the shared loop: reading and checking SQuAD data (``qa_examples``), turning
questions and contexts into windowed features with labels, and turning the model's logits back
into answers and EM / F1. Everything else (devices, precision, batching, logging, saving) is the
loop's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForQuestionAnswering, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes.config import ConfigError, DataConfig
from recipes.data import DataError
from recipes.log import get_logger
from recipes.metrics.squad import squad_v1, squad_v2
from recipes.tasks.base import Averaging, LossShape, RunContext, Task, TaskData
from recipes.tasks.configs.qa import QaConfig
from recipes.tasks.outputs import write_json
from recipes.tasks.qa_answers import AnswerCollector, top_candidates
from recipes.tasks.qa_examples import check_disjoint, check_examples, read_squad_json

log = get_logger(__name__)

FEATURES_VERSION = 1  # bump when feature building changes, to invalidate cached features


@dataclass
class QAData(TaskData):
    """Features plus what evaluation needs to turn logits back into answers."""

    eval_examples: Dataset | None = None
    eval_windows: Dataset | None = None  # offsets and example index per evaluation window
    left_padded: bool = False  # the tokenizer pads on the left: the question comes second


class QuestionAnswering(Task[QAData]):
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

    args: QaConfig

    def loss(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The head's loss, (start + end cross-entropy) / 2 over the windows, with the padding's
        positions left out of the softmax: ``transformers``' own loss scores them as candidate
        answers, so a window's loss would depend on how far its batch pads it. Here it does
        not, so cutting a batch into sub-batches (``trainer.sub_batches``) changes no loss,
        and training sees the positions evaluation reads answers from.
        ``task.loss_ignores_padding=false``: the head's own loss, as the examples train."""
        if not self.args.loss_ignores_padding:  # as the Hugging Face examples train
            return model(**batch).loss
        labels = ("start_positions", "end_positions")
        outputs = model(**{k: v for k, v in batch.items() if k not in labels})
        padding = batch["attention_mask"] == 0
        losses = [
            torch.nn.functional.cross_entropy(
                logits.float().masked_fill(padding, torch.finfo(torch.float32).min), batch[k]
            )
            for logits, k in zip((outputs.start_logits, outputs.end_logits), labels, strict=True)
        ]
        return (losses[0] + losses[1]) / 2

    def loss_shape(self) -> LossShape:
        """A mean over windows that padding does not change, unless the head's own loss."""
        return LossShape(Averaging.row_mean if self.args.loss_ignores_padding else Averaging.mean)

    # ----------------------------------------------------------------------------- data

    def build_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> QAData:
        """Load, check and featurize the train and evaluation splits (cached on disk)."""
        _check_fast(tokenizer)
        splits = data_lib.load_splits(cfg, reader=read_squad_json)
        for role, split in splits.items():
            check_examples(
                split.examples, f"{role} data {split.source}", self.args.version_2_with_negative
            )
        check_disjoint(splits["train"], splits["eval"])
        train = self._features(cfg, tokenizer, splits["train"], "train", self._train_features)
        windows = self._features(cfg, tokenizer, splits["eval"], "eval", self._eval_features)
        if len(train) == 0:
            raise DataError("train data: no features could be built (all contexts empty?).")
        train_examples, eval_examples = splits["train"].examples, splits["eval"].examples
        log.info(
            "train: %d questions -> %d features; eval: %d questions -> %d features",
            len(train_examples),
            len(train),
            len(eval_examples),
            len(windows),
        )
        return QAData(
            train=train,
            eval=_longest_first(windows, tokenizer),
            max_length=self.args.max_seq_length,
            eval_examples=eval_examples,
            eval_windows=windows.select_columns(["offset_mapping", "example_index"]),
            left_padded=tokenizer.padding_side == "left",
        )

    def build_predict_data(self, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> QAData:
        """The questions of ``data.predict_file`` (SQuAD JSON or JSON lines; answers and ids may
        be missing), in evaluation windows."""
        _check_fast(tokenizer)
        split = data_lib.load_predict_file(
            cfg, reader=lambda path: read_squad_json(path, answers_required=False)
        )
        missing = {"question", "context"} - set(split.examples.column_names)
        if missing:
            raise DataError(
                f"data.predict_file={split.source}: no {' or '.join(sorted(missing))} column; "
                "questions to answer need 'question' and 'context'."
            )
        examples = split.examples
        if "id" not in examples.column_names:
            examples = examples.add_column("id", [str(i) for i in range(len(examples))])
        data = self.question_windows(examples, tokenizer)
        log.info("predict: %d questions -> %d features", len(examples), len(data.eval))
        return data

    def question_windows(self, examples: Dataset, tokenizer: PreTrainedTokenizerBase) -> QAData:
        """Questions (``id``, ``question``, ``context``) as evaluation windows, with no training
        features: what mode=predict and ``python -m recipes.answer`` run the model on."""
        with data_lib.map_progress(len(examples)):
            windows = examples.map(
                self._eval_features,
                batched=True,
                with_indices=True,
                remove_columns=examples.column_names,
                fn_kwargs={"tokenizer": tokenizer},
                desc="question windows",
            )
        return QAData(
            train=windows.select([]),
            eval=_longest_first(windows, tokenizer),
            max_length=self.args.max_seq_length,
            eval_examples=examples,
            eval_windows=windows.select_columns(["offset_mapping", "example_index"]),
            left_padded=tokenizer.padding_side == "left",
        )

    def _features(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerBase,
        split: data_lib.Split,
        role: str,
        featurize: Callable[..., dict],
    ) -> Dataset:
        """The split's features, built by ``featurize`` once and cached on disk."""
        examples = split.examples

        def build() -> Dataset:
            with data_lib.map_progress(len(examples)):
                return examples.map(
                    featurize,
                    batched=True,
                    with_indices=role == "eval",
                    remove_columns=examples.column_names,
                    fn_kwargs={"tokenizer": tokenizer},
                    num_proc=cfg.preprocessing_num_workers,
                    desc=f"{role} features",
                )

        return data_lib.cached_features(
            cfg,
            "qa",
            role,
            split,
            tokenizer,
            build,
            task=self.features_key(),
            version=FEATURES_VERSION,
        )

    def _tokenize(self, examples: Mapping[str, list], tokenizer: PreTrainedTokenizerBase):
        questions = [q.lstrip() for q in examples["question"]]
        # Cut overlong questions at a token boundary, as BERT's original SQuAD code does, so that
        # a rambling question cannot squeeze the context out of the window.
        cut = tokenizer(
            questions,
            add_special_tokens=False,
            truncation=True,
            max_length=self.args.max_query_length,
            return_offsets_mapping=True,
        )
        questions = [
            q[: offs[-1][1]] if offs else q
            for q, offs in zip(questions, cut["offset_mapping"], strict=True)
        ]
        pad_right = tokenizer.padding_side != "left"
        first, second = (
            (questions, examples["context"]) if pad_right else (examples["context"], questions)
        )
        encoded = tokenizer(
            first,
            second,
            truncation="only_second" if pad_right else "only_first",
            max_length=self.args.max_seq_length,
            stride=self.args.doc_stride,
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

    def evaluate(
        self, model: torch.nn.Module, loader: Iterable[dict], data: QAData, run: RunContext
    ) -> dict[str, float]:
        """Answer every evaluation question, score EM / F1, write the predictions files."""
        collector = self.collect(model, loader, data, run.accelerator)
        if collector is None:
            return {}
        predictions, null_odds = self._answers(collector, data.eval_examples, run.output_dir)
        return self._score(predictions, null_odds, data.eval_examples)

    def predict(
        self, model: torch.nn.Module, loader: Iterable[dict], data: QAData, run: RunContext
    ) -> dict[str, Any]:
        """``predictions.json`` ({id: answer}), and ``nbest_predictions.json`` with
        ``task.write_nbest``, ``null_odds.json`` for v2: evaluation's files, without scores."""
        collector = self.collect(model, loader, data, run.accelerator)
        if collector is not None:
            self._answers(collector, data.eval_examples, run.output_dir)
        return {"rows": len(data.eval_examples), "file": "predictions.json"}

    def collect(
        self,
        model: torch.nn.Module,
        loader: Iterable[dict[str, torch.Tensor]],
        data: QAData,
        accelerator: Accelerator,
    ) -> AnswerCollector | None:
        """The top start / end candidates of every window of ``loader``, collected on the main
        process (None on the others): every process runs its share of the windows, and only
        their top candidates are gathered. The caller puts the model in eval mode, without
        autograd (:func:`recipes.evaluation.eval_mode`)."""
        collector = None
        if accelerator.is_main_process:
            collector = AnswerCollector(
                data.eval_windows, self.args.n_best_size, self.args.max_answer_length
            )
        # A long context is many windows: a bar (after a few seconds, main process) says so.
        windows, processes = len(data.eval_windows), accelerator.num_processes
        with data_lib.progress(total=windows, desc="answer: windows", unit=" windows") as bar:
            for batch in loader:
                feature_index = batch.pop("feature_index")
                done = min(len(feature_index) * processes, bar.total - bar.n)
                outputs = model(**batch)
                candidates = top_candidates(
                    outputs.start_logits,
                    outputs.end_logits,
                    batch["attention_mask"],
                    self.args.n_best_size,
                    data.left_padded,
                )
                candidates["feature_index"] = feature_index
                candidates = accelerator.gather_for_metrics(candidates)
                if collector is not None:
                    arrays = {k: v.cpu().numpy() for k, v in candidates.items()}
                    collector.add(arrays, arrays.pop("feature_index"))
                bar.update(done)
        return collector

    def _answers(
        self, collector: AnswerCollector, examples: Dataset, output_dir: Path | None
    ) -> tuple[dict[str, str], dict[str, float]]:
        """Every question's answer and (v2) null odds; written into ``output_dir`` when there is
        one: ``predictions.json``, ``nbest_predictions.json`` (``task.write_nbest``) and
        ``null_odds.json`` (v2)."""
        with_nbest = self.args.write_nbest and output_dir is not None
        predictions, nbest, null_odds = collector.answers(
            examples,
            self.args.version_2_with_negative,
            self.args.null_score_diff_threshold,
            with_nbest,
        )
        if output_dir is not None:
            write_json(output_dir / "predictions.json", predictions)
            if with_nbest:
                write_json(output_dir / "nbest_predictions.json", nbest)
            if null_odds:
                write_json(output_dir / "null_odds.json", null_odds)
        return predictions, null_odds

    def _score(
        self, predictions: dict[str, str], null_odds: dict[str, float], examples: Dataset
    ) -> dict[str, float]:
        references = {
            qid: answers["text"]
            for qid, answers in zip(examples["id"], examples["answers"], strict=True)
        }
        if self.args.version_2_with_negative:
            # The main numbers score the predictions as made; null_odds only feed the search
            # for the best threshold (best_f1_thresh is in null_score_diff_threshold's units).
            scores = squad_v2(
                predictions, references, no_answer_probs=null_odds, no_answer_threshold=float("inf")
            )
        else:
            scores = squad_v1(predictions, references)
        return {k: float(v) for k, v in scores.items() if k != "total"}


def _check_fast(tokenizer: PreTrainedTokenizerBase) -> None:
    if not tokenizer.is_fast:
        raise ConfigError(
            "model.name_or_path: question answering needs a fast tokenizer (offset mappings); "
            "this model only has a slow one."
        )


def _longest_first(windows: Dataset, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """The model inputs of the evaluation windows, longest first, each with its feature_index.

    Batches of similar lengths carry little padding, which makes evaluation about twice as fast
    as file order on a CPU. Answers are collected by feature_index, so the order changes no
    score; the longest batch comes first, so an out-of-memory shows at once.
    """
    model_inputs = [c for c in tokenizer.model_input_names if c in windows.column_names]
    by_length = np.argsort(-data_lib.feature_lengths(windows), kind="stable")
    return (
        windows.select_columns(model_inputs)
        .add_column("feature_index", list(range(len(windows))))
        .select(by_length, keep_in_memory=True)  # an index map in memory, no cache file
    )
