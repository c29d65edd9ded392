"""A stand-in for Hugging Face's ``examples/pytorch/question-answering/run_qa.py`` (Trainer-based).

Runs the reference recipe on the same model, data and settings as ``train.py recipe=bert_squad``
so that EM / F1 and speed can be compared side by side. Written from the documented behaviour of
``run_qa.py``, ``utils_qa.py`` and ``trainer_qa.py`` (not copied):

* features: question (left-stripped) + context, ``truncation="only_second"``, ``stride``,
  overflowing windows, offsets, padded to ``max_seq_length``; a training window is labelled with
  the tokens of ``answers[0]`` or with the CLS index when the answer is not wholly inside it;
  evaluation windows keep ``example_id`` and offsets (``None`` outside the context);
* training: ``transformers.Trainer`` with ``default_data_collator`` and the Trainer's own
  optimizer (AdamW, no decay on biases and LayerNorm), schedule, clipping and seeding;
* evaluation: ``trainer.predict`` on all evaluation windows, then the ``postprocess_qa_predictions``
  search (n-best start x end logits per window, longest answer 30 tokens), scored with the
  project's official SQuAD v1.1 metric.

Deliberate differences: ``--max-train-examples`` / ``--max-eval-examples`` keep the first N
*questions* and all of their windows (``run_qa.py``'s ``max_*_samples`` also cut the windows to N),
because that is what ``data.max_train_examples`` means in this project; data is read with the
project's SQuAD reader; only ``predictions.json`` is written (no n-best file); no checkpoints.

Usage (from the repository root)::

    python scripts/hf_reference_qa.py --model PATH --train-file train-v1.1.json \\
        --eval-file dev-v1.1.json [--max-seq-length 384 --doc-stride 128 --batch-size 24 \\
        --eval-batch-size 64 --lr 3e-5 --epochs 2 | --max-steps N --scheduler cosine \\
        --warmup-ratio 0.0 --weight-decay 0.01 --seed 42 --max-train-examples N \\
        --max-eval-examples N --output-dir DIR]

Prints one JSON line with the results and writes it to ``DIR/results.json``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

# Offline by default: the model and data are local files. The hub libraries read these on import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Run from a checkout without `pip install -e .`: put the repository root on the import path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import transformers
from datasets import Dataset
from transformers import (
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from recipes.metrics.squad import squad_v1
from recipes.tasks.qa import read_squad_json

log = logging.getLogger("hf_reference_qa")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Reads the command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The parsed settings.
    """
    parser = argparse.ArgumentParser(
        description="Hugging Face run_qa.py-style SQuAD v1.1 fine-tuning with transformers.Trainer.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model directory or hub name")
    parser.add_argument("--train-file", required=True, type=Path, help="official SQuAD JSON")
    parser.add_argument("--eval-file", required=True, type=Path, help="official SQuAD JSON")
    parser.add_argument("--max-seq-length", type=int, default=384)
    parser.add_argument("--doc-stride", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=24, help="per-device train batch")
    parser.add_argument("--eval-batch-size", type=int, default=64, help="per-device eval batch")
    parser.add_argument("--lr", type=float, default=3e-5)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=float, default=2.0)
    length.add_argument("--max-steps", type=int, default=-1, help="> 0: train this many steps")
    parser.add_argument("--scheduler", default="cosine", help="TrainingArguments.lr_scheduler_type")
    parser.add_argument("--warmup-ratio", type=float, default=0.0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max-train-examples", type=int, default=None, help="first N questions")
    parser.add_argument("--max-eval-examples", type=int, default=None, help="first N questions")
    parser.add_argument("--n-best-size", type=int, default=20)
    parser.add_argument("--max-answer-length", type=int, default=30)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (TrainingArguments)")
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast (TrainingArguments)")
    parser.add_argument("--tf32", action="store_true", help="TF32 matmuls (Ampere+ GPUs only)")
    parser.add_argument("--optim", default=None, help="TrainingArguments.optim (default: its own)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/hf_reference_qa"))
    args = parser.parse_args(argv)
    if args.doc_stride >= args.max_seq_length:
        parser.error("--doc-stride must be smaller than --max-seq-length")
    if not 0.0 <= args.warmup_ratio < 1.0:
        parser.error("--warmup-ratio must be in [0, 1)")
    if args.bf16 and args.fp16:
        parser.error("--bf16 and --fp16 exclude each other")
    for name in ("max_train_examples", "max_eval_examples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def load_examples(path: Path, limit: int | None) -> Dataset:
    """Reads an official SQuAD JSON file with the project's reader, keeping the first rows.

    Args:
        path: Nested SQuAD v1.1 JSON file.
        limit: Keep the first ``limit`` questions; ``None`` keeps all.

    Returns:
        One row per question: id, title, context, question, answers{text, answer_start}.

    Raises:
        SystemExit: If the file is not in the official nested layout.
    """
    dataset = read_squad_json(path)
    if dataset is None:
        raise SystemExit(f"{path}: not an official nested SQuAD JSON file")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset


def _tokenize(
    examples: dict[str, list[Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    doc_stride: int,
) -> Any:
    """Tokenizes question / context pairs into overlapping, padded windows (as run_qa.py)."""
    pad_on_right = tokenizer.padding_side == "right"
    # Leading whitespace in a question only eats into the context's share of the window.
    questions = [q.lstrip() for q in examples["question"]]
    contexts = examples["context"]
    return tokenizer(
        questions if pad_on_right else contexts,
        contexts if pad_on_right else questions,
        truncation="only_second" if pad_on_right else "only_first",
        max_length=max_seq_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )


def prepare_train_features(
    examples: dict[str, list[Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    doc_stride: int,
) -> Any:
    """Builds labelled training windows from a batch of questions.

    Each window is labelled with the first and last token of the first gold answer, or with the
    CLS token on both ends when that answer is not wholly inside the window's context.

    Args:
        examples: A batch of rows (question, context, answers).
        tokenizer: A fast tokenizer (offsets are needed).
        max_seq_length: Tokens per window.
        doc_stride: Tokens shared by consecutive windows.

    Returns:
        The tokenized windows with ``start_positions`` and ``end_positions``.
    """
    pad_on_right = tokenizer.padding_side == "right"
    context_index = 1 if pad_on_right else 0
    tokenized = _tokenize(examples, tokenizer, max_seq_length, doc_stride)
    sample_mapping = tokenized.pop("overflow_to_sample_mapping")
    offset_mapping = tokenized.pop("offset_mapping")
    starts: list[int] = []
    ends: list[int] = []
    for i, offsets in enumerate(offset_mapping):
        input_ids = tokenized["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id)
        sequence_ids = tokenized.sequence_ids(i)
        answers = examples["answers"][sample_mapping[i]]
        if len(answers["answer_start"]) == 0:
            starts.append(cls_index)
            ends.append(cls_index)
            continue
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        # First and last token of the context in this window.
        first = 0
        while sequence_ids[first] != context_index:
            first += 1
        last = len(input_ids) - 1
        while sequence_ids[last] != context_index:
            last -= 1
        if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
            starts.append(cls_index)
            ends.append(cls_index)
            continue
        # Walk in from both ends of the context to the tokens that hold the answer's edges.
        while first < len(offsets) and offsets[first][0] <= start_char:
            first += 1
        starts.append(first - 1)
        while offsets[last][1] >= end_char:
            last -= 1
        ends.append(last + 1)
    tokenized["start_positions"] = starts
    tokenized["end_positions"] = ends
    return tokenized


def prepare_eval_features(
    examples: dict[str, list[Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    doc_stride: int,
) -> Any:
    """Builds evaluation windows that remember their question and the context's offsets.

    Args:
        examples: A batch of rows (id, question, context).
        tokenizer: A fast tokenizer (offsets are needed).
        max_seq_length: Tokens per window.
        doc_stride: Tokens shared by consecutive windows.

    Returns:
        The tokenized windows with ``example_id`` and ``offset_mapping`` (``None`` for every
        token that is not part of the context).
    """
    context_index = 1 if tokenizer.padding_side == "right" else 0
    tokenized = _tokenize(examples, tokenizer, max_seq_length, doc_stride)
    sample_mapping = tokenized.pop("overflow_to_sample_mapping")
    example_ids: list[str] = []
    for i in range(len(tokenized["input_ids"])):
        sequence_ids = tokenized.sequence_ids(i)
        example_ids.append(examples["id"][sample_mapping[i]])
        tokenized["offset_mapping"][i] = [
            offset if sequence_ids[k] == context_index else None
            for k, offset in enumerate(tokenized["offset_mapping"][i])
        ]
    tokenized["example_id"] = example_ids
    return tokenized


def postprocess_qa_predictions(
    examples: Dataset,
    features: Dataset,
    predictions: tuple[np.ndarray, np.ndarray],
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """Turns start / end logits of all windows into one answer text per question (SQuAD v1.1).

    For every window of a question, the ``n_best_size`` best start and end tokens are paired;
    pairs outside the context, reversed, or longer than ``max_answer_length`` tokens are dropped,
    and the pair with the highest start + end logit over all windows wins. A question left
    without a candidate is answered ``"empty"``, as in ``utils_qa.py``.

    Args:
        examples: The evaluation questions (id, context).
        features: Their windows, in the order of the logits (example_id, offset_mapping).
        predictions: ``(start_logits, end_logits)``, each ``[num_windows, seq_len]``.
        n_best_size: Start and end candidates per window.
        max_answer_length: Longest answer, in tokens.

    Returns:
        Question id -> predicted answer text.

    Raises:
        ValueError: If the logits do not match the windows.
    """
    if len(predictions) != 2:
        raise ValueError("predictions must be (start_logits, end_logits)")
    all_start_logits, all_end_logits = predictions
    if len(all_start_logits) != len(features):
        raise ValueError(f"{len(all_start_logits)} predictions for {len(features)} windows")
    # Whole columns once: indexing the Dataset row by row would re-read Arrow for every window.
    feature_example_ids = features["example_id"]
    feature_offsets = features["offset_mapping"]
    example_index = {qid: i for i, qid in enumerate(examples["id"])}
    windows_per_example: dict[int, list[int]] = collections.defaultdict(list)
    for i, qid in enumerate(feature_example_ids):
        windows_per_example[example_index[qid]].append(i)

    answers: dict[str, str] = {}
    for i, (qid, context) in enumerate(zip(examples["id"], examples["context"], strict=True)):
        candidates: list[tuple[float, int, int]] = []  # (score, start char, end char)
        for window in windows_per_example[i]:
            start_logits = all_start_logits[window]
            end_logits = all_end_logits[window]
            offsets = feature_offsets[window]
            start_indexes = np.argsort(start_logits)[-1 : -n_best_size - 1 : -1].tolist()
            end_indexes = np.argsort(end_logits)[-1 : -n_best_size - 1 : -1].tolist()
            for start in start_indexes:
                for end in end_indexes:
                    if (
                        start >= len(offsets)
                        or end >= len(offsets)
                        or offsets[start] is None
                        or len(offsets[start]) < 2
                        or offsets[end] is None
                        or len(offsets[end]) < 2
                    ):
                        continue  # not in the context
                    if end < start or end - start + 1 > max_answer_length:
                        continue
                    score = start_logits[start] + end_logits[end]
                    candidates.append((score, offsets[start][0], offsets[end][1]))
        # Stable sort on the score alone: ties keep the search order, as in utils_qa.py.
        best = sorted(candidates, key=lambda c: c[0], reverse=True)[:n_best_size]
        texts = [context[begin:stop] for _, begin, stop in best]
        if not texts or (len(texts) == 1 and texts[0] == ""):
            texts.insert(0, "empty")
        answers[qid] = texts[0]
    return answers


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    """Builds the Trainer's settings, across transformers 4.x and 5.x.

    transformers 5 dropped ``warmup_ratio``; there a float ``warmup_steps`` below 1 is the ratio.

    Args:
        args: The command line settings.

    Returns:
        The TrainingArguments (no evaluation during training, no checkpoints, no trackers).
    """
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    kwargs: dict[str, Any] = {
        "output_dir": str(args.output_dir),
        "per_device_train_batch_size": args.batch_size,
        "per_device_eval_batch_size": args.eval_batch_size,
        "learning_rate": args.lr,
        "num_train_epochs": args.epochs,
        "max_steps": args.max_steps,
        "lr_scheduler_type": args.scheduler,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "logging_steps": args.logging_steps,
        "report_to": [],
        "save_strategy": "no",
        "bf16": args.bf16,
        "fp16": args.fp16,
    }
    if "warmup_ratio" in fields:
        kwargs["warmup_ratio"] = args.warmup_ratio
    else:
        kwargs["warmup_steps"] = args.warmup_ratio
    if args.tf32:
        kwargs["tf32"] = True
    if args.optim is not None:
        kwargs["optim"] = args.optim
    return TrainingArguments(**kwargs)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Fine-tunes and evaluates like run_qa.py, then reports EM / F1 and speed.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The results that are printed and written to ``<output-dir>/results.json``.
    """
    args = parse_args(argv)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO,
    )
    training_args = training_arguments(args)
    # As run_qa.py: seed before the model is built, so the new QA head starts the same way.
    set_seed(training_args.seed)

    train_examples = load_examples(args.train_file, args.max_train_examples)
    eval_examples = load_examples(args.eval_file, args.max_eval_examples)
    log.info("%d training and %d evaluation questions", len(train_examples), len(eval_examples))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if not getattr(tokenizer, "is_fast", False):
        raise SystemExit(f"{args.model}: needs a fast tokenizer (offset mappings)")
    max_seq_length = args.max_seq_length
    if max_seq_length > tokenizer.model_max_length:
        log.warning(
            "--max-seq-length %d exceeds the model's maximum %d; using %d",
            max_seq_length,
            tokenizer.model_max_length,
            tokenizer.model_max_length,
        )
        max_seq_length = tokenizer.model_max_length
    model = AutoModelForQuestionAnswering.from_pretrained(args.model)

    with training_args.main_process_first(desc="feature building"):
        train_features = train_examples.map(
            partial(
                prepare_train_features,
                tokenizer=tokenizer,
                max_seq_length=max_seq_length,
                doc_stride=args.doc_stride,
            ),
            batched=True,
            remove_columns=train_examples.column_names,
            desc="train features",
        )
        eval_features = eval_examples.map(
            partial(
                prepare_eval_features,
                tokenizer=tokenizer,
                max_seq_length=max_seq_length,
                doc_stride=args.doc_stride,
            ),
            batched=True,
            remove_columns=eval_examples.column_names,
            desc="eval features",
        )
    log.info("%d training and %d evaluation windows", len(train_features), len(eval_features))

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_features,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    train_result = trainer.train()
    train_metrics = train_result.metrics
    steps = trainer.state.global_step

    # Logits of every window, concatenated in order; Trainer drops example_id / offset_mapping.
    prediction = trainer.predict(eval_features, metric_key_prefix="eval")
    started = time.perf_counter()
    predicted = postprocess_qa_predictions(
        eval_examples,
        eval_features,
        prediction.predictions,
        n_best_size=args.n_best_size,
        max_answer_length=args.max_answer_length,
    )
    postprocess_s = time.perf_counter() - started
    references = {
        qid: answers["text"]
        for qid, answers in zip(eval_examples["id"], eval_examples["answers"], strict=True)
    }
    scores = squad_v1(predicted, references)

    results: dict[str, Any] = {
        "exact_match": scores["exact_match"],
        "f1": scores["f1"],
        "eval_questions": scores["total"],
        "train_runtime_s": train_metrics["train_runtime"],
        "train_steps": steps,
        "train_samples_per_second": train_metrics["train_samples_per_second"],
        "s_per_step": train_metrics["train_runtime"] / steps if steps else math.nan,
        "train_loss": train_metrics.get("train_loss"),
        "eval_runtime_s": prediction.metrics["eval_runtime"],
        "eval_samples_per_second": prediction.metrics.get("eval_samples_per_second"),
        "postprocess_runtime_s": postprocess_s,
        "num_train_examples": len(train_examples),
        "num_eval_examples": len(eval_examples),
        "num_train_features": len(train_features),
        "num_eval_features": len(eval_features),
        "model": args.model,
        "train_file": str(args.train_file),
        "eval_file": str(args.eval_file),
        "max_seq_length": max_seq_length,
        "doc_stride": args.doc_stride,
        "per_device_train_batch_size": args.batch_size,
        "per_device_eval_batch_size": args.eval_batch_size,
        "world_size": training_args.world_size,
        "learning_rate": args.lr,
        "num_train_epochs": args.epochs if args.max_steps <= 0 else None,
        "max_steps": args.max_steps if args.max_steps > 0 else None,
        "lr_scheduler_type": args.scheduler,
        "warmup_ratio": args.warmup_ratio,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "max_train_examples": args.max_train_examples,
        "max_eval_examples": args.max_eval_examples,
        "n_best_size": args.n_best_size,
        "max_answer_length": args.max_answer_length,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        "tf32": args.tf32,
        "optim": str(getattr(training_args.optim, "value", training_args.optim)),
        "device": str(training_args.device),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    if trainer.is_world_process_zero():
        args.output_dir.mkdir(parents=True, exist_ok=True)
        with (args.output_dir / "results.json").open("w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
        with (args.output_dir / "predictions.json").open("w", encoding="utf-8") as handle:
            json.dump(predicted, handle, indent=2, ensure_ascii=False)
        log.info("wrote %s", args.output_dir / "results.json")
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
