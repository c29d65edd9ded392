"""Answer questions with a trained extractive-QA model (a run's ``final/``), from the command line.

    python -m recipes.answer outputs/bert_squad/<run>/final \\
        --question "Where is the grotto?" --context "The grotto is at Lourdes ..."
    python -m recipes.answer <final/> --file questions.jsonl --out predictions.json

transformers 5 removed the question-answering pipeline; this is its replacement for the models
the project trains, and it answers as a run's evaluation does: the same windows over a long
context (the task's ``max_seq_length`` / ``doc_stride``), the same n-best search over start and
end logits, and for SQuAD v2 models the same null-answer threshold (:mod:`recipes.tasks.qa`,
:mod:`recipes.tasks.qa_answers`). The task settings are the run's own (``config.yaml`` beside
``final/``), else the task's defaults; the flags change the answer search. The device is
accelerate's (MUSA, CUDA or CPU), and batches are padded and computed (autocast) as the run's
evaluations were, so the answers are the run's.

``--file``: JSON lines of ``{"question", "context"}`` (``id`` optional), or a SQuAD JSON file
(answers, when present, are ignored). Prints one answer per line (``id<TAB>answer`` for a file),
and with ``--out`` writes ``{id: answer}`` (the official SQuAD predictions format) and, with
``--n-best``, the candidates with their probabilities beside it. Work that takes more than a few
seconds (a long context's windows, a large file) draws a progress bar on stderr
(``--no-progress``: none).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

QA_TASK = "recipes.tasks.qa.QuestionAnswering"


def answer(
    model_dir: Path,
    questions: Dataset,
    *,
    n_best: int | None = None,
    threshold: float | None = None,
    batch_size: int | None = None,
    mixed_precision: str | None = None,
) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """The answer to each of ``questions`` (``id``, ``question``, ``context``), and their n-best
    lists, from the QA model saved in ``model_dir``: the task's evaluation windows and answer
    collection (:meth:`recipes.tasks.qa.QuestionAnswering.collect`) on accelerate's device, in
    batches padded and computed as the run's evaluations were (its ``trainer.*`` settings)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding

    from recipes.config import TrainerConfig
    from recipes.evaluation import eval_mode
    from recipes.model import backend_kwargs
    from recipes.session import resolve_mixed_precision

    saved = _run_config(model_dir)
    task = _task(model_dir, saved.get("task"), n_best, threshold)
    trainer = {**vars(TrainerConfig()), "mixed_precision": "no", **saved.get("trainer", {})}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = task.question_windows(questions, tokenizer)
    accelerator = Accelerator(
        mixed_precision=resolve_mixed_precision(mixed_precision or str(trainer["mixed_precision"]))
    )
    model = AutoModelForQuestionAnswering.from_pretrained(model_dir, **backend_kwargs())
    fixed = str(trainer["padding"]) == "max_length"
    padding = DataCollatorWithPadding(
        tokenizer,
        padding="max_length" if fixed else "longest",
        max_length=data.max_length if fixed else None,
        pad_to_multiple_of=trainer["pad_to_multiple_of"],
    )
    loader = DataLoader(
        data.eval,
        batch_size=batch_size or trainer["per_device_eval_batch_size"],
        collate_fn=padding,
    )
    model, loader = accelerator.prepare(model, loader)
    with eval_mode(model):
        collector = task.collect(model, loader, data, accelerator)
    settings = task.args
    predictions, nbest, _ = collector.answers(
        data.eval_examples,
        settings.version_2_with_negative,
        settings.null_score_diff_threshold,
        True,
    )
    return predictions, nbest


def _run_config(model_dir: Path) -> dict[str, Any]:
    """The resolved config of the run that saved ``model_dir`` (its ``config.yaml``), or {}."""
    from omegaconf import OmegaConf

    run_config = model_dir.parent / "config.yaml"
    if not run_config.is_file():
        return {}
    return OmegaConf.to_container(OmegaConf.load(run_config), resolve=False)  # type: ignore[return-value]


def _task(
    model_dir: Path, saved: dict[str, Any] | None, n_best: int | None, threshold: float | None
) -> Any:
    """The QA task as the run that saved ``model_dir`` had it (``saved``), else with the task's
    defaults (``QaConfig``); ``n_best`` / ``threshold`` replace the run's."""
    from omegaconf import OmegaConf

    from recipes.modes import build_task
    from recipes.tasks.configs.qa import QaConfig

    if saved is not None and saved.get("_target_") != QA_TASK:
        raise SystemExit(f"error: {model_dir} was trained by {saved.get('_target_')}, not task=qa.")
    settings = OmegaConf.merge(OmegaConf.structured(QaConfig), saved or {})
    if n_best is not None:
        settings.n_best_size = n_best
    if threshold is not None:
        settings.null_score_diff_threshold = threshold
    config = OmegaConf.to_object(settings)
    config.validate()
    return build_task(config)


def read_questions(path: Path) -> Dataset:
    """The questions of a JSON lines file (``question``, ``context``, optional ``id``) or of a
    SQuAD JSON file, checked as training data is (:func:`recipes.tasks.qa_examples.read_squad_json`:
    a row without a question or context is refused with its place); answers are not needed."""
    from recipes.data import DataError
    from recipes.tasks.qa_examples import read_squad_json

    try:
        questions = read_squad_json(path, answers_required=False)
    except DataError as err:
        raise SystemExit(f"error: {err}") from None
    if questions is None:
        raise SystemExit(f"error: {path}: give JSON lines (.jsonl) or SQuAD JSON (.json).")
    return questions.select_columns(["id", "question", "context"])


def _empty_flags(question: str, context: str) -> list[str]:
    """The flags of the single-question form that hold no text (whitespace is none)."""
    return [
        flag
        for flag, text in (("--question", question), ("--context", context))
        if not text.strip()
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.answer", description=__doc__)
    parser.add_argument("model", type=Path, help="a QA run's final/ (or any QA model folder)")
    parser.add_argument("--question")
    parser.add_argument("--context")
    parser.add_argument("--file", type=Path, help="JSON lines of question/context, or SQuAD JSON")
    parser.add_argument("--out", type=Path, help="write {id: answer} here (SQuAD's format)")
    parser.add_argument("--n-best", type=int, help="candidates to keep (and write with --out)")
    parser.add_argument("--threshold", type=float, help="SQuAD v2 null-score threshold")
    parser.add_argument("--batch-size", type=int, help="windows per batch (the run's eval batch)")
    parser.add_argument(
        "--mixed-precision",
        choices=["auto", "no", "bf16", "fp16"],
        help="autocast (default: the run's trainer.mixed_precision; fp32 without a run config)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (one shows when the model works for a few seconds)",
    )
    args = parser.parse_args(argv)
    if (args.file is None) == (args.question is None or args.context is None):
        parser.error("give --question and --context, or --file")
    if args.file is None and (empty := _empty_flags(args.question, args.context)):
        # As --file refuses such a row: a model always "answers" (a placeholder, a word).
        parser.exit(
            2,
            f"{parser.prog}: error: {' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} "
            "empty; give the question to answer with --question and the text that holds its "
            "answer with --context.\n",
        )
    if not (args.model / "config.json").is_file():
        parser.error(f"{args.model}: no model here (config.json); give a run's final/ folder")
    from recipes.data import show_progress
    from recipes.log import quiet_libraries

    quiet_libraries()
    show_progress(not args.no_progress)
    from datasets import Dataset

    questions = (
        read_questions(args.file)
        if args.file
        else Dataset.from_list([{"id": "0", "question": args.question, "context": args.context}])
    )
    predictions, nbest = answer(
        args.model,
        questions,
        n_best=args.n_best,
        threshold=args.threshold,
        batch_size=args.batch_size,
        mixed_precision=args.mixed_precision,
    )
    for qid, text in predictions.items():
        print(f"{qid}\t{text}" if args.file else text)
    if args.out:
        args.out.write_text(json.dumps(predictions, indent=2, ensure_ascii=False))
        if args.n_best:
            nbest_out = args.out.with_name(f"nbest_{args.out.name}")
            nbest_out.write_text(json.dumps(nbest, indent=2, ensure_ascii=False, default=float))
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
