"""Reading and checking SQuAD data: the QA task's examples, before any feature is built.

SQuAD JSON (the official nested v1.1 / v2.0 files, transformers' flat rows, JSON lines) is read
here rather than by ``datasets`` so that every way a file goes wrong is refused with one line
naming the file, the place in it (``data[0].paragraphs[3].qas[1]``, ``line 7``, the question id)
and the fix; data read by ``datasets`` (parquet, ``save_to_disk``) gets the same checks by row.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, Value

try:
    from datasets import List  # datasets >= 4
except ImportError:  # older datasets (MUSA images) call it Sequence
    from datasets import Sequence as List

from recipes import data as data_lib
from recipes.data import DataError
from recipes.log import get_logger

log = get_logger(__name__)

COLUMNS = ("id", "context", "question", "answers")
MAX_REPORTED_PROBLEMS = 5


def read_squad_json(path: Path, answers_required: bool = True) -> Dataset | None:
    """Read SQuAD JSON or JSON lines into one row per question, checking its layout.

    Three layouts are read: the official nested file (v1.1 / v2.0: ``{"data": [{"title",
    "paragraphs": [{"context", "qas": [...]}]}]}``), the flat rows of transformers' question-
    answering examples (``{"data": [{"id", "title", "context", "question", "answers"}]}``, what
    ``run_qa.py --train_file`` reads) and JSON lines of such rows. Rows to predict on
    (``answers_required=False``) may lack ``answers`` and ``id`` (then their number, from 0). ``answers`` may be a list of
    ``{"text", "answer_start"}`` objects or ``{"text": [...], "answer_start": [...]}``. The rows
    have the columns of the hub's ``squad`` / ``squad_v2``; unanswerable v2.0 questions get empty
    answer lists (their ``plausible_answers`` are not answers). Returns None for other file types
    (parquet, ...), which ``datasets`` reads.
    """
    if path.suffix not in (".json", ".jsonl"):
        return None
    text = data_lib.read_text(path)
    if not text.strip():
        raise DataError(
            f"{path}: the file is empty; give a SQuAD JSON file with questions (or check that "
            "it was written or downloaded completely)."
        )
    problems: list[str] = []
    rows = [
        row
        for n, (place, raw) in enumerate(_questions(path, text, problems))
        if (row := _question_row(place, _unlabelled(raw, n, answers_required), problems))
        is not None
    ]
    problems += _duplicate_ids([(row["id"], row.pop("place")) for row in rows])
    if problems:
        raise DataError(
            _problems_line(
                path, problems, "problem", "Fix those entries or remove those questions."
            )
        )
    dataset = Dataset.from_dict({name: [row[name] for row in rows] for name in ROW_FEATURES})
    # Inferring the types is several times faster than encoding every row with the features;
    # only a file whose questions all lack answers (list<null>) or are all missing needs the cast.
    return dataset if dataset.features == ROW_FEATURES else dataset.cast(ROW_FEATURES)


ROW_FEATURES = Features(
    {
        "id": Value("string"),
        "title": Value("string"),
        "context": Value("string"),
        "question": Value("string"),
        "answers": {"text": List(Value("string")), "answer_start": List(Value("int64"))},
    }
)
QUESTION_ROW = '{"id", "context", "question", "answers"}'


def _questions(path: Path, text: str, problems: list[str]) -> Iterator[tuple[str, Any]]:
    """(where, question) for each question of the file, the question flattened to a row
    (its paragraph's context and article's title added); layout problems go to ``problems``."""
    if path.suffix == ".jsonl" or _is_json_lines(text):
        yield from _json_lines(path, text)
        return
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(_json_error(path, text, err)) from None
    if isinstance(raw, dict) and "data" not in raw and {"context", "question"} <= raw.keys():
        yield "line 1", raw  # JSON lines of a single question
        return
    entries = raw.get("data") if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        if not isinstance(raw, dict):
            found = f"its top level is {_kind(raw)}"
        else:
            found = f"'data' is {_kind(entries)}" if "data" in raw else "it has no 'data' key"
        raise DataError(
            f"{path}: {found}; SQuAD JSON is an object whose 'data' is a list of articles "
            f'({{"title", "paragraphs"}}) or of question rows ({QUESTION_ROW}).'
        )
    prefix = "data" if isinstance(raw, dict) else ""
    # Articles have paragraphs; rows have a question or context. A file of neither is read as
    # articles, so that the message names the missing "paragraphs".
    nested = any(isinstance(e, dict) and "paragraphs" in e for e in entries) or not any(
        isinstance(e, dict) and ("question" in e or "context" in e) for e in entries
    )
    for a, entry in enumerate(entries):
        where = f"{prefix}[{a}]"
        if nested:
            yield from _article_questions(where, entry, problems)
        else:
            yield where, entry


def _article_questions(where: str, article: Any, problems: list[str]) -> Iterator[tuple[str, Any]]:
    if not isinstance(article, dict):
        problems.append(
            f'{where}: an article must be an object {{"title", "paragraphs"}}; '
            f"found {_kind(article)}"
        )
        return
    if not isinstance(article.get("paragraphs"), list):
        problems.append(
            f'{where}: \'paragraphs\' must be a list of {{"context", "qas"}} objects; '
            f"{_found(article, 'paragraphs')}"
        )
        return
    title = article.get("title")
    for p, paragraph in enumerate(article["paragraphs"]):
        here = f"{where}.paragraphs[{p}]"
        if not isinstance(paragraph, dict):
            problems.append(
                f'{here}: a paragraph must be an object {{"context", "qas"}}; '
                f"found {_kind(paragraph)}"
            )
            continue
        wrong = [
            f"'{key}' must be {what}; {_found(paragraph, key)}"
            for key, what, ok in (
                ("context", "a string", isinstance(paragraph.get("context"), str)),
                ("qas", "a list of questions", isinstance(paragraph.get("qas"), list)),
            )
            if not ok
        ]
        if wrong:
            problems.append(f"{here}: {'; '.join(wrong)}")
            continue
        for q, qa in enumerate(paragraph["qas"]):
            extra = {"context": paragraph["context"], "title": title}
            yield f"{here}.qas[{q}]", {**qa, **extra} if isinstance(qa, dict) else qa


def _found(mapping: Mapping[str, Any], key: str) -> str:
    return f"found {_kind(mapping[key])}" if key in mapping else "it is missing"


def _is_json_lines(text: str) -> bool:
    """A .json file holding JSON lines (datasets reads those too): its first line is a whole
    object and more follows."""
    first, _, rest = text.lstrip().partition("\n")
    if not rest.strip():
        return False
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    # A whole SQuAD file on the first line with more after it is JSON with extra data.
    return isinstance(row, dict) and "data" not in row


def _json_lines(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    # Split at newlines only: splitlines() also splits at U+2028 and friends, which JSON allows
    # unescaped inside strings.
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}: line {n} is not valid JSON ({err.msg} at column {err.colno}); each "
                f"line of a JSON lines file must be one question {QUESTION_ROW}. Fix or remove "
                "that line."
            ) from None


def _json_error(path: Path, text: str, err: json.JSONDecodeError) -> str:
    where = f"{path}: not valid JSON at line {err.lineno} column {err.colno}"
    if err.msg == "Extra data":  # e.g. two files joined into one
        return (
            f"{where} (more data after the end of the JSON document). Keep one document per "
            "file: remove what follows, or split it into its own file."
        )
    # A string running to the end of the file is the usual sign of a download cut short.
    cut = not text[err.pos :].strip() or err.msg.startswith("Unterminated string")
    ends = "; the file ends before it is complete: cut short?" if cut else ""
    return (
        f"{where} ({err.msg.removesuffix(' at')}{ends}). Fix the file there (a missing comma, "
        "quote or bracket?)."
    )


def _unlabelled(raw: Any, number: int, answers_required: bool) -> Any:
    """A question to predict on, read as one without answers (and numbered, without an id)."""
    if answers_required or not isinstance(raw, dict):
        return raw
    return {"id": str(number), **raw} | ({} if raw.get("answers") else {"answers": []})


def _question_row(place: str, raw: Any, problems: list[str]) -> dict[str, Any] | None:
    """The question as a row of ``ROW_FEATURES`` (and its place), or None with the reasons
    added to ``problems``."""
    if not isinstance(raw, dict):
        problems.append(f"{place}: a question must be an object {QUESTION_ROW}; found {_kind(raw)}")
        return None
    qid = raw.get("id")
    label = f"{place} (id {qid})" if isinstance(qid, (str, int)) else place
    missing = [key for key in ("id", "context", "question", "answers") if raw.get(key) is None]
    if missing:
        problems.append(f"{label}: lacks {', '.join(missing)}")
        return None
    wrong = [
        f"'{key}' must be a string, found {_kind(raw[key])}"
        for key in ("context", "question")
        if not isinstance(raw[key], str)
    ]
    if isinstance(qid, bool) or not isinstance(qid, (str, int)) or not str(qid).strip():
        wrong.append(f"'id' must be a non-empty string, found {_kind(qid)}")
    answers = _answer_columns(raw["answers"])
    if isinstance(answers, str):
        wrong.append(answers)
    elif raw.get("is_impossible") is True and answers[0]:
        wrong.append(
            f"is_impossible is true but it has {len(answers[0])} answer(s); empty 'answers' "
            "(plausible answers go in 'plausible_answers') or set is_impossible to false"
        )
    if not wrong and not raw["context"].strip():
        wrong.append("empty context")
    elif not wrong and not raw["question"].strip():
        wrong.append("empty question")
    elif not wrong and any(start > len(raw["context"]) for start in answers[1]):
        wrong.append(
            f"answer_start={max(answers[1])} is past the end of the context "
            f"({len(raw['context'])} characters)"
        )
    if wrong:
        problems.append(f"{label}: {'; '.join(wrong)}")
        return None
    title = raw.get("title")
    return {
        "id": str(qid),
        "title": "" if title is None else str(title),
        "context": raw["context"],
        "question": raw["question"],
        "answers": {"text": answers[0], "answer_start": answers[1]},
        "place": place,
    }


ANSWERS_SHAPE = (
    '\'answers\' must be a list of {"text", "answer_start"} objects or '
    '{"text": [...], "answer_start": [...]}'
)


NO_ANSWER = (
    "a question without an answer has no answers ('answers': []; SQuAD v2.0, recipe=bert_squad_v2)"
)


def _answer_columns(answers: Any) -> tuple[list[str], list[int]] | str:
    """``answers`` in either SQuAD shape as (texts, start offsets), or what is wrong with it."""
    if isinstance(answers, dict):
        texts, starts = answers.get("text"), answers.get("answer_start")
        if not (isinstance(texts, list) and isinstance(starts, list)):
            return f"{ANSWERS_SHAPE}, found text {_kind(texts)}, answer_start {_kind(starts)}"
        if len(texts) != len(starts):
            return f"'answers' has {len(texts)} text(s) but {len(starts)} answer_start(s)"
        pairs = list(zip(texts, starts, strict=True))
    elif isinstance(answers, list) and all(
        isinstance(a, dict) and "text" in a and "answer_start" in a for a in answers
    ):
        pairs = [(a["text"], a["answer_start"]) for a in answers]
    else:
        return f"{ANSWERS_SHAPE}, found {_kind(answers)}"
    texts_out, starts_out = [], []
    for n, (text, start) in enumerate(pairs):
        offset = _offset(start)
        if not isinstance(text, str):
            return f"answer {n}: 'text' must be a string, found {_kind(text)}"
        if not text.strip():  # also the "" at -1 some exports write for "no answer"
            return f"answer {n}: 'text' is empty: {NO_ANSWER}"
        if offset is None:
            return f"answer {n}: answer_start={start!r} is not a character offset (an integer >= 0)"
        texts_out.append(text)
        starts_out.append(offset)
    return texts_out, starts_out


def _offset(value: Any) -> int | None:
    """A character offset written as an integer, or as one in a string or a float (spreadsheet
    and pandas exports write those); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and value >= 0 else None


def _duplicate_ids(ids_and_places: list[tuple[str, str]]) -> list[str]:
    """One problem per id used more than once, with every place it is used."""
    places: dict[str, list[str]] = defaultdict(list)
    for qid, place in ids_and_places:
        places[qid].append(place)
    return [
        f"id {qid!r} is used {len(where)} times ({', '.join(where[:3])}"
        f"{', ...' if len(where) > 3 else ''}) but ids must be unique (predictions and scores are "
        "keyed by them)"
        for qid, where in places.items()
        if len(where) > 1
    ]


def _kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (with the value, when short)."""
    if isinstance(value, list):
        inside = sorted({_json_type(item) for item in value})
        return f"a list of {', '.join(inside)}" if inside else "an empty list"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value[:30]!r}"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return "an object"


def _json_type(value: Any) -> str:
    if value is None:
        return "nulls"
    if isinstance(value, bool):
        return "booleans"
    if isinstance(value, (int, float)):
        return "numbers"
    if isinstance(value, str):
        return "strings"
    return "lists" if isinstance(value, list) else "objects"


def _problems_line(source: str | Path, problems: list[str], noun: str, fix: str) -> str:
    shown = "; ".join(problems[:MAX_REPORTED_PROBLEMS])
    more = len(problems) - MAX_REPORTED_PROBLEMS
    return (
        f"{source}: {len(problems)} {noun}(s): {shown}"
        + (f"; and {more} more" if more > 0 else "")
        + f". {fix}"
    )


def check_examples(dataset: Dataset, source: str, allow_unanswerable: bool) -> None:
    """Refuse data whose labels are broken, naming the question and the field.

    Training on an answer whose ``answer_start`` does not point at its text silently teaches the
    model wrong spans, so every offset is checked once, before any feature is built. Data that
    did not come through :func:`read_squad_json` (parquet, ``save_to_disk``) has its types
    checked here too, and ids must be unique: predictions and scores are keyed by them.
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
    ids: list[tuple[str, str]] = []
    columns = dataset.select_columns(list(COLUMNS))[:]  # far faster than iterating rows
    for i, values in enumerate(zip(*(columns[c] for c in COLUMNS), strict=True)):
        row = dict(zip(COLUMNS, values, strict=True))
        qid = row["id"]
        if qid is None or not str(qid).strip():
            problems.append(f"row {i}: no id")
            continue
        ids.append((str(qid), f"row {i}"))
        wrong = _wrong_types(row)
        if wrong:
            problems.append(f"id {qid}: {wrong}")
            continue
        problems += [f"id {qid}: {problem}" for problem in _label_problems(row, allow_unanswerable)]
    problems += _duplicate_ids(ids)
    if problems:
        raise DataError(
            _problems_line(
                source, problems, "broken example", "Fix the file or remove those questions."
            )
        )


def check_disjoint(train: data_lib.Split, held: data_lib.Split) -> None:
    """Refuse a question id in both parts of a held-out split (the file repeats it); warn when
    separate train and eval files share ids.

    Shared ids between two files usually mean evaluation questions were also trained on (an
    evaluation set cut from the training file), which inflates EM / F1. They are not refused:
    two data sets numbered independently ("1", "2", ...) share ids without sharing questions,
    and a run that evaluates on its training data on purpose is legitimate.
    """
    shared = set(train.examples["id"]) & set(held.examples["id"])
    if not shared:
        return
    some = ", ".join(repr(qid) for qid in sorted(shared)[:3]) + (", ..." if len(shared) > 3 else "")
    if held.held_out:
        raise DataError(
            f"train data {train.source}: {len(shared)} id(s) ({some}) are used more than once "
            "(they fell in both the training and the held-out part); ids must be unique "
            "(predictions and scores are keyed by them). Fix the file."
        )
    trained = dict(zip(train.examples["id"], train.examples["question"], strict=True))
    same = sum(
        trained.get(qid) == question
        for qid, question in zip(held.examples["id"], held.examples["question"], strict=True)
        if qid in shared
    )
    log.warning(
        "train data %s and eval data %s share %d question id(s) (%s), %d of them with the same "
        "question: if the evaluation questions were also trained on, EM / F1 overstate the model. "
        "Evaluate on questions kept out of training (e.g. the official dev set).",
        train.source,
        held.source,
        len(shared),
        some,
        same,
    )


def _wrong_types(row: Mapping[str, Any]) -> str | None:
    """What is of the wrong type in a row read by ``datasets`` (None when nothing is)."""
    for key in ("context", "question"):
        if not isinstance(row[key], str):
            return f"'{key}' must be a string, found {_kind(row[key])}"
    answers = row["answers"]
    texts = answers.get("text") if isinstance(answers, dict) else None
    starts = answers.get("answer_start") if isinstance(answers, dict) else None
    if not (
        isinstance(texts, list)
        and isinstance(starts, list)
        and all(isinstance(t, str) for t in texts)
        and all(isinstance(s, int) and not isinstance(s, bool) for s in starts)
    ):
        found = f"text {_kind(texts)}, answer_start {_kind(starts)}"
        return '\'answers\' must be {"text": [strings], "answer_start": [integers]}, found ' + (
            found if isinstance(answers, dict) else _kind(answers)
        )
    return None


def _label_problems(row: Mapping[str, Any], allow_unanswerable: bool) -> list[str]:
    context, answers = row["context"], row["answers"]
    problems = []
    if not context.strip():
        problems.append("empty context")
    if not row["question"].strip():
        problems.append("empty question")
    texts, starts = answers["text"], answers["answer_start"]
    if len(texts) != len(starts):
        return [*problems, f"{len(texts)} answer texts but {len(starts)} answer_start"]
    if not texts and not allow_unanswerable:
        problems.append(
            "no answer (SQuAD v2.0 data? use recipe=bert_squad_v2 or "
            "task.version_2_with_negative=true)"
        )
    for n, (text, start) in enumerate(zip(texts, starts, strict=True)):
        if not text.strip():
            problems.append(f"answers.text[{n}] is empty: {NO_ANSWER}")
            continue
        found = context[start : start + len(text)] if start >= 0 else None
        if found != text:
            problems.append(
                f"answers.answer_start[{n}]={start} points at {found!r}, "
                f"not at the answer text {text!r}"
            )
    return problems
