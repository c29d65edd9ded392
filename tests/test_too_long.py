"""A split whose every row is too long for ``task.max_seq_length`` (dropped, or cut until no
reply is left) stops the run with one line naming the length settings and the fix, before the
feature cache is written: ``datasets`` cannot load an empty saved split back, so the cache
refuses to save one, and an empty split an older release cached is built again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, make_task, run_train
from datasets import Dataset, DatasetDict

from recipes import data as data_lib
from recipes.config import DataConfig, ModelConfig
from recipes.data import DataError
from recipes.model import load_tokenizer

LONG = " ".join(["word"] * 120)  # far over 48 tokens
MAX = "48"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(ROOT / "recipes/assets/tiny-llama")))


def _conversation(question: str, reply: str) -> dict:
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    }


def _pair(question: str, reply: str) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": reply}],
        "rejected": [{"role": "assistant", "content": "No."}],
    }


def _write(folder: Path, name: str, rows: list[dict]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


# role whose rows are all too long, truncation, where the length is: the reply (too long for
# drop) or the question (a cut leaves no reply token, so truncate drops the row too)
CASES = [
    ("train", "drop", "reply"),
    ("eval", "drop", "reply"),
    ("train", "truncate", "question"),
    ("eval", "truncate", "question"),
]


@pytest.mark.parametrize(
    "kind,make_row,what", [("sft", _conversation, "conversation"), ("dpo", _pair, "pair")]
)
@pytest.mark.parametrize("role,truncation,long_part", CASES)
def test_a_split_with_no_row_that_fits_is_refused_before_caching(
    tmp_path, tokenizer, kind, make_row, what, role, truncation, long_part
):
    long_row = make_row(LONG, "Yes.") if long_part == "question" else make_row("Why?", LONG)
    short = [make_row(f"Question {i}?", "Yes.") for i in range(4)]
    folder = tmp_path / "data"
    _write(folder, "train.jsonl", [long_row] * 4 if role == "train" else short)
    _write(folder, "dev.jsonl", [long_row] * 3 if role == "eval" else short)
    cache = tmp_path / "cache"
    task = make_task(kind, chat_template="zephyr", max_seq_length=int(MAX), truncation=truncation)
    with pytest.raises(DataError) as refused:
        task.build_data(DataConfig(path=str(folder), cache_dir=str(cache)), tokenizer)
    message = str(refused.value)
    rows = 4 if role == "train" else 3
    assert message.startswith(
        f"{role} data {folder / ('train' if role == 'train' else 'dev')}.jsonl"
    )
    assert f"every {what} ({rows}) was dropped" in message
    assert f"task.max_seq_length={MAX}" in message and f"task.truncation={truncation}" in message
    assert "raise task.max_seq_length" in message
    # Nothing cached for the refused split (the other may be): the next run refuses again.
    assert not list(cache.glob(f"{kind}-{role}-*"))


def test_the_cache_refuses_to_save_an_empty_split(tmp_path):
    folder = tmp_path / "features"
    with pytest.raises(DataError, match="built no rows"):
        data_lib.cached(folder, lambda: Dataset.from_dict({"input_ids": []}))
    parts = DatasetDict(
        train=Dataset.from_dict({"input_ids": [[1, 2]]}), eval=Dataset.from_dict({"input_ids": []})
    )
    with pytest.raises(DataError, match=r"\(split eval\)"):
        data_lib.cached(folder, lambda: parts)
    assert not folder.exists() and not list(tmp_path.glob("features.tmp*"))


def test_an_empty_split_an_older_release_cached_is_built_again(tmp_path):
    folder = tmp_path / "features"
    # What datasets writes for a mapped split with no rows, which load_from_disk cannot read.
    Dataset.from_dict({"input_ids": [[1]]}).save_to_disk(str(folder))
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, "_data_files": []}))
    (folder / ".complete").touch()
    with pytest.raises(IndexError):  # the failure this guards against
        Dataset.load_from_disk(str(folder))
    built = data_lib.cached(folder, lambda: Dataset.from_dict({"input_ids": [[1, 2], [3]]}))
    assert built["input_ids"] == [[1, 2], [3]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,what", [("llama_sft", "conversation"), ("llama_dpo", "pair"), ("llama_kto", "row")]
)
def test_the_run_stops_with_one_line_and_exit_code_2(tmp_path, recipe, what):
    proc = run_train(
        f"recipe={recipe}",
        "debug=smoke",
        "logger=none",
        "trainer.progress_bar=false",
        "task.max_seq_length=8",
        "task.truncation=drop",
        f"output_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: train data ") and f"every {what} " in last
    assert "task.max_seq_length=8 (task.truncation=drop)" in last
