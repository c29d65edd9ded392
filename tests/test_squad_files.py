"""Every SQuAD file a user may give loads, or is refused with one line naming the file, the
place and the fix, before anything is written: small files derived from the bundled real
slice, run through the real loading path (``QuestionAnswering.build_data``) and, for a few,
through ``python train.py``."""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import make_task, run_train
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from recipes import data as data_lib
from recipes.config import ASSETS, DataConfig
from recipes.data import DataError
from recipes.tasks.qa import QAData
from recipes.tasks.qa_examples import check_examples, read_squad_json

V1 = ASSETS / "squad" / "v1"
V2 = ASSETS / "squad" / "v2"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-bert")


def _dev() -> dict:
    return json.loads((V1 / "dev.json").read_text())


def _qa(raw: dict, a: int = 0, p: int = 0, q: int = 0) -> dict:
    return raw["data"][a]["paragraphs"][p]["qas"][q]


def _nested(mutate: Callable[[dict], object]) -> str:
    raw = _dev()
    mutate(raw)
    return json.dumps(raw, indent=1)


def _rows() -> list[dict]:
    """The bundled dev slice as flat rows (transformers' layout), first three questions."""
    return read_squad_json(V1 / "dev.json").select(range(3)).to_list()


def _jsonl(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _with(row: dict, **changes: object) -> dict:
    return {**row, **changes}


def _build(
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
    train: Path,
    eval_file: Path | None = V1 / "dev.json",
    version: int = 1,
    **data: object,
) -> QAData:
    cfg = DataConfig(
        path=str(train),
        train_file=str(train),
        eval_file=None if eval_file is None else str(eval_file),
        cache_dir=str(tmp_path / "cache"),
        **data,
    )
    task = make_task(
        "qa",
        version_2_with_negative=version == 2,
        max_seq_length=128,
        doc_stride=48,
        max_query_length=32,
    )
    return task.build_data(cfg, tokenizer)


def _refused(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path, train: Path, **kwargs: object
) -> str:
    with pytest.raises(DataError) as err:
        _build(tokenizer, tmp_path, train, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    # Refused before any feature was built: no cache folder, not even a half-written one.
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    return message


ROW = {
    "id": "q1",
    "title": "T",
    "context": "Paris is in France.",
    "question": "Where is Paris?",
    "answers": {"text": ["France"], "answer_start": [12]},
}

# (file name, its text, what the one-line message must name: the place and the thing to fix)
MALFORMED = [
    pytest.param("train.json", "", ["the file is empty"], id="empty-file"),
    pytest.param("train.json", " \n\n", ["the file is empty"], id="blank-file"),
    pytest.param(
        "train.json", "[1, 2]", ["[0]: an article must be an object"], id="list-of-numbers"
    ),
    pytest.param("train.json", '"squad"', ["top level is the string 'squad'"], id="json-string"),
    pytest.param("train.json", '{"version": "1.1"}', ["no 'data' key"], id="no-data-key"),
    pytest.param(
        "train.json", '{"data": {"title": "x"}}', ["'data' is an object"], id="data-not-list"
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: raw["data"][1].pop("paragraphs")),
        ["data[1]: 'paragraphs' must be a list", "missing"],
        id="article-without-paragraphs",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: raw["data"][0].update(paragraphs={"context": "x"})),
        ["data[0]: 'paragraphs' must be a list", "found an object"],
        id="paragraphs-not-list",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: raw["data"][0]["paragraphs"][2].update(qas="none")),
        ["data[0].paragraphs[2]: 'qas' must be a list"],
        id="qas-not-list",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: raw["data"][0]["paragraphs"][0]["qas"].__setitem__(1, "What?")),
        ["data[0].paragraphs[0].qas[1]: a question must be an object"],
        id="qas-entry-not-object",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: raw["data"][0]["paragraphs"][1].update(context=["a", "b"])),
        ["data[0].paragraphs[1]: 'context' must be a string", "a list of strings"],
        id="context-not-string",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw, q=2).update(question=7)),
        ["data[0].paragraphs[0].qas[2] (id 572657d9dd62a815002e8232): 'question' must be a string"],
        id="question-not-string",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw, q=1).update(answers={"text": "melt", "answer_start": 238})),
        ["qas[1] (id 572657d9dd62a815002e8231): 'answers' must be", "found text the string"],
        id="answers-dict-of-scalars",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw).update(answers="melt")),
        ["qas[0] (id 572657d9dd62a815002e8230): 'answers' must be", "the string 'melt'"],
        id="answers-string",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw)["answers"][1].update(answer_start=238.5)),
        ["qas[0] (id 572657d9dd62a815002e8230): answer 1: answer_start=238.5"],
        id="answer-start-fraction",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw)["answers"][0].update(answer_start="two")),
        ["answer 0: answer_start='two' is not a character offset"],
        id="answer-start-word",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw)["answers"][0].update(answer_start=None)),
        ["answer 0: answer_start=None"],
        id="answer-start-null",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw, p=1).pop("id")),
        ["data[0].paragraphs[1].qas[0]: lacks id"],
        id="id-missing",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw, p=1, q=1).update(id=None)),
        ["data[0].paragraphs[1].qas[1]: lacks id"],
        id="id-null",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw, a=2, q=3).update(id=_qa(raw, q=1)["id"])),
        [
            "id '572657d9dd62a815002e8231' is used 2 times",
            "data[0].paragraphs[0].qas[1], data[2].paragraphs[0].qas[3]",
            "must be unique",
        ],
        id="duplicate-ids",
    ),
    pytest.param(
        "train.jsonl",
        _jsonl(_rows()[:2]) + '{"id": "x", "context": \n' + _jsonl(_rows()[2:]),
        ["line 3 is not valid JSON"],
        id="jsonl-bad-line",
    ),
    pytest.param(
        "train.jsonl",
        _jsonl([ROW, [1, 2], _with(ROW, id="q3")]),
        ["line 2: a question must be an object", "found a list of numbers"],
        id="jsonl-line-not-object",
    ),
    pytest.param(
        "train.jsonl",
        _jsonl([ROW, _with(ROW, id="q2", answers=[{"text": "France"}])]),
        ["line 2 (id q2): 'answers' must be"],
        id="jsonl-answers-list-without-start",
    ),
    pytest.param(
        "train.jsonl",
        _jsonl([ROW, _with(ROW, id="q2", context=12)]),
        ["line 2 (id q2): 'context' must be a string"],
        id="jsonl-mixed-types",
    ),
    pytest.param(
        "train.json",
        json.dumps({"data": [ROW, _with(ROW, id="q1", question="Which country?")]}),
        ["id 'q1' is used 2 times (data[0], data[1])"],
        id="rows-duplicate-ids",
    ),
    pytest.param(
        "train.json",
        json.dumps({"data": [ROW, {"id": "q2", "context": "c"}]}),
        ["data[1] (id q2): lacks question, answers"],
        id="rows-missing-fields",
    ),
    pytest.param(
        "train.json",
        json.dumps({"data": [_with(ROW, answers={"text": ["France"], "answer_start": []})]}),
        ["data[0] (id q1): 'answers' has 1 text(s) but 0 answer_start(s)"],
        id="rows-answers-unequal",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw)["answers"][0].update(answer_start=3)),
        ["id 572657d9dd62a815002e8230: answers.answer_start[0]=3 points at"],
        id="answer-start-wrong-place",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw).update(answers=[])),
        ["id 572657d9dd62a815002e8230: no answer", "recipe=bert_squad_v2"],
        id="v2-data-for-v1-recipe",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw)["answers"][0].update(text=" ")),
        ["data[0].paragraphs[0].qas[0]", "answer 0: 'text' is empty", "'answers': []"],
        id="answer-text-blank",
    ),
    pytest.param(
        "train.jsonl",
        _jsonl([ROW, _with(ROW, id="q2", answers={"text": [""], "answer_start": [-1]})]),
        ["line 2 (id q2): answer 0: 'text' is empty", "'answers': []"],
        id="no-answer-written-as-empty-text",
    ),
    pytest.param(
        "train.json",
        _nested(lambda raw: _qa(raw)["answers"][0].update(answer_start=10**30)),
        ["data[0].paragraphs[0].qas[0]", f"answer_start={10**30} is past the end of the context"],
        id="answer-start-beyond-int64",
    ),
    pytest.param(
        "train.json",
        json.dumps(_dev()) + "\n" + json.dumps(_dev()),
        ["not valid JSON at line 2 column 1", "more data after the end of the JSON document"],
        id="two-files-joined",
    ),
]


@pytest.mark.parametrize("name,text,expected", MALFORMED)
def test_malformed_file_is_refused_naming_the_place(tokenizer, tmp_path, name, text, expected):
    bad = tmp_path / name
    bad.write_text(text, encoding="utf-8")
    message = _refused(tokenizer, tmp_path, bad)
    assert message.startswith(f"{bad}: ") or f"data {bad}: " in message
    for part in expected:
        assert part in message


def test_json_syntax_error_names_line_and_column(tokenizer, tmp_path):
    text = json.dumps(_dev(), indent=1)
    broken = text.replace('"id": ', '"id" ', 1)  # a missing colon
    line = broken[: broken.index('"id" ')].count("\n") + 1
    bad = tmp_path / "train.json"
    bad.write_text(broken)
    message = _refused(tokenizer, tmp_path, bad)
    assert f"line {line} column" in message and "Expecting ':' delimiter" in message
    bad.write_text(text[: len(text) // 2])  # a download cut short
    assert "cut short?" in _refused(tokenizer, tmp_path, bad)


def test_file_not_in_utf8_names_the_byte(tokenizer, tmp_path):
    data = json.dumps(_dev(), indent=1).encode()
    at = data.index(b"igneous")
    latin1 = data[:at] + b"\xe9" + data[at + 1 :]  # "égneous" as Windows-1252 writes it
    bad = tmp_path / "train.json"
    bad.write_bytes(latin1)
    message = _refused(tokenizer, tmp_path, bad)
    line = data[:at].count(b"\n") + 1
    assert f"not UTF-8: byte {at} (line {line}," in message
    assert "iconv" in message
    bad.write_bytes(codecs.BOM_UTF16_LE + data.decode().encode("utf-16-le"))
    assert "is UTF-16" in _refused(tokenizer, tmp_path, bad)


def test_v2_question_marked_impossible_with_answers(tokenizer, tmp_path):
    raw = json.loads((V2 / "dev.json").read_text())
    answered = next(
        (a, p, q)
        for a, article in enumerate(raw["data"])
        for p, paragraph in enumerate(article["paragraphs"])
        for q, qa in enumerate(paragraph["qas"])
        if qa["answers"]
    )
    _qa(raw, *answered)["is_impossible"] = True
    bad = tmp_path / "train.json"
    bad.write_text(json.dumps(raw))
    message = _refused(tokenizer, tmp_path, bad, eval_file=V2 / "dev.json", version=2)
    a, p, q = answered
    assert f"data[{a}].paragraphs[{p}].qas[{q}]" in message
    assert "is_impossible is true but it has" in message


def test_data_too_small_to_hold_out_an_eval_split(tokenizer, tmp_path):
    one = tmp_path / "train.json"
    one.write_text(json.dumps({"data": [ROW]}))
    message = _refused(tokenizer, tmp_path, one, eval_file=None)
    assert f"train data {one}: 1 example(s) are too few to hold out" in message
    assert "data.eval_file=" in message


def test_parquet_and_saved_data_are_checked_too(tokenizer, tmp_path):
    """Data that ``datasets`` reads (not the JSON reader) gets the same checks, by row / id."""
    rows = _rows()
    bad = tmp_path / "train.parquet"
    Dataset.from_list([_with(row, answers="melt") for row in rows]).to_parquet(bad)
    assert "id 572657d9dd62a815002e8230: 'answers' must be" in _refused(tokenizer, tmp_path, bad)
    Dataset.from_list([rows[0], rows[1], _with(rows[2], id=rows[0]["id"])]).to_parquet(bad)
    message = _refused(tokenizer, tmp_path, bad)
    assert f"id {rows[0]['id']!r} is used 2 times (row 0, row 2)" in message
    blank = _with(rows[1], answers={"text": [""], "answer_start": [0]})
    Dataset.from_list([rows[0], blank, rows[2]]).to_parquet(bad)
    message = _refused(tokenizer, tmp_path, bad)
    assert f"id {rows[1]['id']}: answers.text[0] is empty" in message
    saved = tmp_path / "saved"
    without_id = Dataset.from_list([_with(rows[0], id=None), *rows[1:]])
    DatasetDict({"train": without_id}).save_to_disk(str(saved))
    assert "row 0: no id" in _refused(tokenizer, tmp_path, saved)


def test_id_in_both_parts_of_a_held_out_split_is_refused(tokenizer, tmp_path):
    rows = _rows()
    twice = tmp_path / "train.parquet"
    Dataset.from_list([rows[0], _with(rows[1], id=rows[0]["id"])]).to_parquet(twice)
    message = _refused(tokenizer, tmp_path, twice, eval_file=None, eval_fraction=0.5)
    assert f"1 id(s) ({rows[0]['id']!r}) are used more than once" in message


def test_folder_without_data_files(tokenizer, tmp_path):
    empty = tmp_path / "squad"
    empty.mkdir()
    (empty / "README.md").write_text("questions to come")
    with pytest.raises(DataError, match=r"squad: no train file \(looked for train\*"):
        data_lib.load_split(DataConfig(path=str(empty)), "train", reader=read_squad_json)


def test_datasets_parse_errors_say_what_and_where(tmp_path):
    """The generic reader (other tasks' JSON lines) reports the parser's error, not datasets'
    "An error occurred while generating the dataset"."""
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"text": "a", "label": 1}\n{"text": "b",\n')
    with pytest.raises(DataError) as err:
        data_lib.load_split(DataConfig(path=str(bad)), "train")
    assert "JSON parse error" in str(err.value) and "row 1" in str(err.value)


# ------------------------------------------------------------------------------ what loads


def _same_questions(loaded: Dataset, reference: Dataset) -> None:
    assert loaded["id"] == reference["id"]
    assert loaded["context"] == reference["context"]
    assert loaded["answers"] == reference["answers"]


def _examples_layout(tmp_path: Path) -> Path:
    """The bundled train slice as transformers' run_qa.py --train_file reads it."""
    rows = read_squad_json(V1 / "train.json").to_list()
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"version": "1.1", "data": rows}))
    return path


def test_transformers_examples_layout_loads(tokenizer, tmp_path):
    data = _build(tokenizer, tmp_path, _examples_layout(tmp_path))
    reference = read_squad_json(V1 / "train.json")
    assert len(data.train) >= len(reference)  # one feature per question at least
    split = data_lib.load_split(
        DataConfig(path=str(tmp_path / "train.json")), "train", reader=read_squad_json
    )
    _same_questions(split.examples, reference)


def _answers_as_objects(row: dict) -> dict:
    pairs = zip(row["answers"]["text"], row["answers"]["answer_start"], strict=True)
    return _with(row, answers=[{"text": t, "answer_start": s} for t, s in pairs])


LOADS = [
    pytest.param("train.json", lambda rows: json.dumps(rows), id="top-level-list-of-rows"),
    pytest.param("train.json", lambda rows: _jsonl(rows), id="json-lines-named-json"),
    pytest.param("train.jsonl", lambda rows: _jsonl(rows), id="json-lines"),
    pytest.param(
        "train.json", lambda rows: "\ufeff" + json.dumps({"data": rows}), id="byte-order-mark"
    ),
    pytest.param(
        "train.jsonl",
        lambda rows: _jsonl([_answers_as_objects(r) for r in rows]),
        id="answers-as-objects-in-rows",
    ),
    pytest.param(
        "train.json",
        lambda rows: json.dumps(
            {
                "data": [
                    _with(
                        r,
                        answers={
                            "text": r["answers"]["text"],
                            "answer_start": [str(s) for s in r["answers"]["answer_start"]],
                        },
                    )
                    for r in rows
                ]
            }
        ),
        id="answer-start-numeric-strings",
    ),
    pytest.param("train.json", lambda rows: json.dumps(rows[0]), id="single-row-object"),
]


@pytest.mark.parametrize("name,write", LOADS)
def test_other_layouts_load_the_same_questions(tmp_path, name, write):
    rows = _rows()
    path = tmp_path / name
    path.write_text(write(rows), encoding="utf-8")
    loaded = data_lib.load_split(DataConfig(path=str(path)), "train", reader=read_squad_json)
    check_examples(loaded.examples, str(path), allow_unanswerable=False)
    expected = Dataset.from_list(rows)
    _same_questions(loaded.examples, expected.select(range(len(loaded.examples))))


def test_json_lines_keep_line_separators_inside_strings(tmp_path):
    """JSON may hold U+2028 unescaped in a string: it does not end a JSON line."""
    row = _with(ROW, question="Where\u2028is Paris?")
    path = tmp_path / "train.jsonl"
    path.write_text(_jsonl([ROW]).replace("q1", "q0") + json.dumps(row, ensure_ascii=False) + "\n")
    assert read_squad_json(path)["question"] == [ROW["question"], row["question"]]


def test_nested_answers_given_as_columns_load(tmp_path):
    raw = _dev()
    for article in raw["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                qa["answers"] = {
                    "text": [a["text"] for a in qa["answers"]],
                    "answer_start": [a["answer_start"] for a in qa["answers"]],
                }
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(raw))
    _same_questions(read_squad_json(path), read_squad_json(V1 / "dev.json"))


def test_shared_ids_between_train_and_eval_are_warned_about(tokenizer, tmp_path, caplog):
    raw = _dev()
    leaked = json.loads((V1 / "train.json").read_text())["data"][0]
    raw["data"].append(leaked)
    eval_file = tmp_path / "dev.json"
    eval_file.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="recipes"):
        _build(tokenizer, tmp_path, V1 / "train.json", eval_file=eval_file)
    shared = sum(len(p["qas"]) for p in leaked["paragraphs"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"share {shared} question id(s)" in w and f"{shared} of them with" in w for w in warnings
    )


# ------------------------------------------------------------------------------ as a user runs it

SMOKE = ("recipe=bert_squad", "debug=smoke", "logger=none", "trainer.progress_bar=false")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow  # train.py in a fresh process per case
@pytest.mark.parametrize("case", ["duplicate-ids", "not-utf8", "too-small-to-hold-out"])
def test_train_py_refuses_bad_data_leaving_the_run_untouched(tmp_path, case):
    """One line, exit 2, no traceback; the run being resumed keeps its checkpoint and metrics,
    and no features are cached."""
    raw = json.loads((V1 / "train.json").read_text())
    bad = tmp_path / "train-v1.1.json"
    data = [f"data.train_file={bad}"]
    if case == "duplicate-ids":
        _qa(raw, p=1)["id"] = _qa(raw)["id"]
        bad.write_text(json.dumps(raw))
        expected = [f"id {_qa(raw)['id']!r} is used 2 times", "data[0].paragraphs[1].qas[0]"]
    elif case == "not-utf8":
        bad.write_bytes(json.dumps(raw).replace("rock", "r\xf6ck", 1).encode("latin-1"))
        expected = ["not UTF-8: byte", "iconv"]
    else:
        bad.write_text(json.dumps({"data": [ROW]}))
        data = [f"data.path={bad}"]
        expected = ["1 example(s) are too few to hold out data.eval_fraction=0.05"]
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000005"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 5}')
    (run / "metrics.jsonl").write_text('{"step": 5, "train/loss": 3.2}\n')
    before = _snapshot(run)
    cache = tmp_path / "cache"
    proc = run_train(
        *SMOKE, f"output_dir={run}", "resume=auto", f"data.cache_dir={cache}", *data, check=False
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {bad}: ") or last.startswith(f"error: train data {bad}")
    for part in expected:
        assert part in last
    after = _snapshot(run)
    assert {k: after[k] for k in before} == before  # checkpoint and metrics untouched
    # What the run folder gains is the composed config and the log that holds the error.
    assert set(after) - set(before) <= {"config.yaml", "train.log"}
    assert not cache.exists() or not any(cache.iterdir())
