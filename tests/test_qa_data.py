"""SQuAD reading, checking and feature building, on the bundled real slices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_task
from transformers import AutoTokenizer

from recipes import data as data_lib
from recipes.config import ASSETS, DataConfig
from recipes.data import DataError
from recipes.tasks.qa import check_examples, read_squad_json

V1 = ASSETS / "squad" / "v1"
V2 = ASSETS / "squad" / "v2"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-bert")


def _count_questions(path: Path) -> int:
    raw = json.loads(path.read_text())
    return sum(len(p["qas"]) for a in raw["data"] for p in a["paragraphs"])


def test_nested_squad_json_is_flattened():
    train = read_squad_json(V1 / "train.json")
    assert len(train) == _count_questions(V1 / "train.json")
    assert {"id", "context", "question", "answers"} <= set(train.column_names)
    row = train[0]
    start = row["answers"]["answer_start"][0]
    assert row["context"][start:].startswith(row["answers"]["text"][0])
    v2 = read_squad_json(V2 / "dev.json")
    unanswerable = sum(1 for a in v2["answers"] if not a["text"])
    assert 0 < unanswerable < len(v2)  # plausible_answers of impossible questions are not answers


@pytest.mark.parametrize("form", ["jsonl", "parquet", "save_to_disk", "folder"])
def test_every_input_form_gives_the_same_questions(tmp_path, form):
    flat = read_squad_json(V1 / "train.json")
    if form == "jsonl":
        flat.to_json(tmp_path / "train.jsonl")
        cfg = DataConfig(path=str(tmp_path / "train.jsonl"))
    elif form == "parquet":
        flat.to_parquet(tmp_path / "train.parquet")
        cfg = DataConfig(path=str(tmp_path / "train.parquet"))
    elif form == "save_to_disk":
        from datasets import DatasetDict

        DatasetDict({"train": flat}).save_to_disk(str(tmp_path / "saved"))
        cfg = DataConfig(path=str(tmp_path / "saved"))
    else:
        cfg = DataConfig(path=str(V1))
    split = data_lib.load_split(cfg, "train", reader=read_squad_json)
    assert split.examples["id"] == flat["id"]
    assert split.examples["answers"] == flat["answers"]
    assert split.fingerprint


def _squad_file(tmp_path: Path, mutate) -> Path:
    raw = json.loads((V1 / "dev.json").read_text())
    mutate(raw["data"][0]["paragraphs"][0])
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda p: p["qas"][0]["answers"][0].update(answer_start=3), "answer_start[0]=3 points at"),
        (lambda p: p.update(context=""), "empty context"),
        (lambda p: p["qas"][0].pop("answers"), "lacks answers"),
        (lambda p: p["qas"][0].update(question="  "), "empty question"),
        (lambda p: p["qas"][0].update(answers=[]), "use recipe=bert_squad_v2"),
    ],
)
def test_broken_examples_are_named(tmp_path, mutate, message):
    path = _squad_file(tmp_path, mutate)
    with pytest.raises(DataError) as err:
        check_examples(read_squad_json(path), str(path), allow_unanswerable=False)
    text = str(err.value)
    assert message in text
    first_id = json.loads(path.read_text())["data"][0]["paragraphs"][0]["qas"][0]["id"]
    if "lacks" not in message:
        assert first_id in text and str(path) in text


def test_missing_columns_and_empty_data(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q", "context": "c"}\n')
    loaded = data_lib.load_split(DataConfig(path=str(tmp_path / "train.jsonl")), "train").examples
    with pytest.raises(DataError, match="missing column"):
        check_examples(loaded, "train.jsonl", allow_unanswerable=False)
    with pytest.raises(DataError, match="holds no questions"):
        check_examples(
            loaded.select([]).add_column("id", []).add_column("answers", []),
            "empty",
            allow_unanswerable=False,
        )


def _build(tokenizer, tmp_path, version=1, rows=None, **kwargs):
    task = make_task("qa", version_2_with_negative=version == 2, **kwargs)
    cfg = DataConfig(
        path=str(ASSETS / "squad" / f"v{version}"),
        cache_dir=str(tmp_path),
        max_train_examples=rows,
        max_eval_examples=rows,
    )
    return task, task.build_data(cfg, tokenizer)


@pytest.fixture(scope="module")
def short_windows(tokenizer, tmp_path_factory):
    """The bundled v1 slice in windows of 128 tokens, stride 48 (many windows per question),
    built once for the tests that read it."""
    cache = tmp_path_factory.mktemp("cache")
    return _build(tokenizer, cache, max_seq_length=128, doc_stride=48, max_query_length=32)[1]


def test_train_labels_cover_the_answer_text(tokenizer, short_windows):
    """Decoding the labelled span gives back the answer (modulo the uncased normaliser)."""
    data = short_windows
    examples = read_squad_json(V1 / "train.json")
    answers = {a["text"][0] for a in examples["answers"]}
    normalise = tokenizer.backend_tokenizer.normalizer.normalize_str
    wanted = {"".join(normalise(a).split()) for a in answers}
    labelled = checked = matched = windows_without_answer = 0
    for row in data.train:
        s, e = row["start_positions"], row["end_positions"]
        if s == 0 and e == 0:
            windows_without_answer += 1
            continue
        labelled += 1
        span = tokenizer.decode(row["input_ids"][s : e + 1])
        if "[UNK]" in span:
            continue
        checked += 1
        # Answers that start or end inside a word ("hone" of "iPhone") cover the whole token.
        matched += "".join(span.replace(" ##", "").replace("##", "").split()) in wanted
    assert windows_without_answer > 0  # short windows: some hold no answer and point at CLS
    assert labelled >= len(examples) * 0.97
    assert checked >= labelled * 0.9
    assert matched >= checked * 0.97


def test_eval_windows_keep_ids_and_context_offsets(short_windows):
    data = short_windows
    windows, examples = data.eval_windows, data.eval_examples
    assert len(windows) > len(examples)
    assert sorted(set(windows["example_index"])) == list(range(len(examples)))
    row = windows[0]
    context = examples[row["example_index"]]["context"]
    inside = [(a, b) for a, b in row["offset_mapping"] if a >= 0]
    assert row["offset_mapping"][0] == [-1, -1]  # CLS is not context
    assert inside and all(0 <= a <= b <= len(context) for a, b in inside)
    assert set(data.eval.column_names) >= {"input_ids", "attention_mask", "feature_index"}
    assert "offset_mapping" not in data.eval.column_names


def test_features_are_cached_by_content(tokenizer, tmp_path, caplog):
    settings = {"rows": 64, "max_seq_length": 128, "max_query_length": 32}
    _build(tokenizer, tmp_path, doc_stride=48, **settings)
    folders = sorted(p.name for p in tmp_path.iterdir())
    # A call with other truncation and padding changes the fast tokenizer's state, not its
    # features: the same key.
    tokenizer("a question", "a context", truncation="only_second", max_length=16, padding=True)
    with caplog.at_level("INFO", logger="recipes"):
        _build(tokenizer, tmp_path, doc_stride=48, **settings)
    assert sorted(p.name for p in tmp_path.iterdir()) == folders
    _build(tokenizer, tmp_path, doc_stride=64, **settings)
    assert len(list(tmp_path.iterdir())) == len(folders) + 2  # new settings, new features


def test_features_another_run_cached_meanwhile_are_kept(tmp_path):
    """Two runs sharing a cache (pytest -n 2, or two jobs) may build the same features at once:
    the one that finishes second uses the first's folder and removes its own copy."""
    from datasets import Dataset

    folder = tmp_path / "features"

    def build() -> Dataset:
        data_lib.cached(folder, lambda: Dataset.from_dict({"x": [1]}))  # the other run
        return Dataset.from_dict({"x": [2]})

    assert data_lib.cached(folder, build)["x"] == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["features"]


def test_v2_unanswerable_questions_are_labelled_cls(tokenizer, tmp_path):
    _, data = _build(tokenizer, tmp_path, version=2)
    cls_labels = sum(1 for s in data.train["start_positions"] if s == 0)
    examples = read_squad_json(V2 / "train.json")
    assert cls_labels >= sum(1 for a in examples["answers"] if not a["text"])
