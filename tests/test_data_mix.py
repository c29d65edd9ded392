"""``data.mix``: several weighted sources as the training data, on the bundled real data."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
from conftest import read_metrics, run_train
from hydra import compose, initialize_config_dir

from recipes.config import ASSETS, ConfigError, DataConfig, register_resolvers, validate
from recipes.data import DataError, load_splits
from recipes.tasks import chat
from recipes.tasks.qa import check_examples, read_squad_json

CONF = Path(__file__).resolve().parents[1] / "conf"
CONVERSATIONS = ASSETS / "conversations" / "squad"
SHAKESPEARE = ASSETS / "text" / "tinyshakespeare.txt"
SQUAD = ASSETS / "squad" / "v1"

register_resolvers()


def read_chat(path: Path):
    return chat.read_conversations(path, "auto")


def _key(row: dict) -> str:
    return json.dumps(row["messages"], sort_keys=True)


@pytest.fixture
def two_files(tmp_path) -> tuple[Path, Path]:
    """The bundled training conversations cut in two files (300 and 219 conversations)."""
    lines = (CONVERSATIONS / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(lines[:300]), encoding="utf-8")
    b.write_text("".join(lines[300:]), encoding="utf-8")
    return a, b


def _rows(path: Path) -> set[str]:
    return {_key(r) for r in read_chat(path)}


def _mix(tmp_path, *entries: tuple[Path, float], **kwargs) -> DataConfig:
    mix = [{"path": str(path), "weight": weight} for path, weight in entries]
    return DataConfig(mix=mix, cache_dir=str(tmp_path / "cache"), **kwargs)


def test_weights_repeat_each_source(tmp_path, two_files, caplog):
    a, b = two_files
    cfg = _mix(tmp_path, (a, 2), (b, 1), eval_file=str(CONVERSATIONS / "dev.jsonl"))
    with caplog.at_level(logging.INFO, logger="recipes"):
        splits = load_splits(cfg, read_chat)
    counts = Counter(_key(r) for r in splits["train"].examples)
    assert len(splits["train"].examples) == 2 * 300 + 219
    assert {k for k, n in counts.items() if n == 2} == _rows(a)
    assert {k for k, n in counts.items() if n == 1} == _rows(b)
    assert len(splits["eval"].examples) == 72  # data.eval_file, not weighted
    assert "data.mix[0]" in caplog.text and "300 rows -> 600 (weight 2)" in caplog.text
    assert "data.mix[1]" in caplog.text and "219 rows -> 219 (weight 1)" in caplog.text


def test_fractions_and_held_out_rows_per_source(tmp_path, two_files):
    """Without an evaluation file each source holds out its own share before weighting:
    evaluation never sees a training row, and the weights apply to what is left."""
    a, b = two_files
    splits = load_splits(_mix(tmp_path, (a, 1.5), (b, 0.5)), read_chat)
    held = Counter(_key(r) for r in splits["eval"].examples)
    train = Counter(_key(r) for r in splits["train"].examples)
    assert not set(held) & set(train)
    assert max(held.values()) == 1
    left_a, left_b = _rows(a) - set(held), _rows(b) - set(held)
    assert len(left_a) + len(left_b) + len(held) == 519
    from_a = sum(n for k, n in train.items() if k in left_a)
    from_b = sum(n for k, n in train.items() if k in left_b)
    assert from_a == _kept(1.5, len(left_a)) and from_b == _kept(0.5, len(left_b))
    assert set(train) >= left_a  # every row once, half of them twice
    assert {n for k, n in train.items() if k in left_b} == {1}


def test_the_mix_is_deterministic_and_keyed_by_its_weights(tmp_path, two_files):
    a, b = two_files
    first = load_splits(_mix(tmp_path, (a, 2), (b, 0.5)), read_chat)
    again = load_splits(_mix(tmp_path, (a, 2), (b, 0.5)), read_chat)
    for role in ("train", "eval"):
        assert first[role].examples.to_list() == again[role].examples.to_list()
        assert first[role].fingerprint == again[role].fingerprint
    other = load_splits(_mix(tmp_path, (a, 2), (b, 0.75)), read_chat)
    seeded = load_splits(_mix(tmp_path, (a, 2), (b, 0.5), split_seed=7), read_chat)
    keys = {s["train"].fingerprint for s in (first, other, seeded)}
    assert len(keys) == 3
    assert other["eval"].fingerprint == first["eval"].fingerprint  # held out before weighting


def test_text_files_and_limits(tmp_path):
    """The language-model tasks read through datasets (no reader); max_train_examples then
    keeps a share of every source, as the mix is shuffled."""
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("".join(f"a: {line}" for line in lines[:2000]), encoding="utf-8")
    b.write_text("".join(f"b: {line}" for line in lines[2000:3000]), encoding="utf-8")
    cfg = _mix(tmp_path, (a, 1), (b, 3), eval_file=str(SHAKESPEARE), max_train_examples=1000)
    train = load_splits(cfg)["train"].examples["text"]
    assert len(train) == 1000
    from_b = sum(t.startswith("b: ") for t in train)
    assert 550 < from_b < 650  # b holds 3000 of the 5000 mixed rows


def _kept(weight: float, rows: int) -> int:
    return int(weight * rows + 0.5)  # round half up


def test_each_source_keeps_its_own_evaluation_rule(tmp_path):
    """QA's reader per file: a folder's dev file is its evaluation data, a single file holds
    out data.eval_fraction of itself."""
    flat = read_squad_json(SQUAD / "train.json")
    extra = tmp_path / "extra.jsonl"
    flat.select(range(100)).to_json(extra)
    folder = flat.select(range(100, len(flat)))
    (tmp_path / "squad").mkdir()
    folder.to_json(tmp_path / "squad" / "train.jsonl")
    (tmp_path / "squad" / "dev.json").write_bytes((SQUAD / "dev.json").read_bytes())
    splits = load_splits(_mix(tmp_path, (tmp_path / "squad", 0.5), (extra, 1)), read_squad_json)
    dev = read_squad_json(SQUAD / "dev.json")["id"]
    held = [i for i in splits["eval"].examples["id"] if i not in set(dev)]
    assert len(splits["eval"].examples) == len(dev) + len(held) and len(held) == 5
    assert set(held) <= set(flat["id"][:100])
    assert len(splits["train"].examples) == _kept(0.5, len(folder)) + 95
    check_examples(splits["train"].examples, "train", allow_unanswerable=False)


def test_columns_not_in_every_source_are_dropped(tmp_path, caplog):
    text, table = tmp_path / "a.txt", tmp_path / "b.jsonl"
    text.write_text("one line\nanother\n", encoding="utf-8")
    table.write_text('{"text": "x", "label": 1}\n{"text": "y", "label": 0}\n', encoding="utf-8")
    cfg = _mix(tmp_path, (text, 1), (table, 1), eval_file=str(text))
    with caplog.at_level(logging.WARNING, logger="recipes"):
        train = load_splits(cfg)["train"].examples
    assert train.column_names == ["text"] and len(train) == 4
    assert "column(s) label dropped" in caplog.text


def test_sources_whose_columns_disagree_are_refused(tmp_path):
    text, table = tmp_path / "a.txt", tmp_path / "b.jsonl"
    text.write_text("one line\nanother\n", encoding="utf-8")
    table.write_text('{"text": 1}\n{"text": 2}\n', encoding="utf-8")
    cfg = _mix(tmp_path, (text, 1), (table, 1), eval_file=str(text))
    with pytest.raises(DataError, match=r"data\.mix: the train sources do not share one layout"):
        load_splits(cfg)


def test_a_weight_that_keeps_no_row_is_refused(tmp_path, two_files):
    a, b = two_files
    cfg = _mix(tmp_path, (a, 1), (b, 0.001), eval_file=str(CONVERSATIONS / "dev.jsonl"))
    with pytest.raises(DataError, match=r"data.mix\[1\].weight=0.001: keeps none of the 219"):
        load_splits(cfg, read_chat)


def _validate(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "train", ["output_dir=/tmp/unused", "recipe=llama_sft", "debug=smoke", *overrides]
        )
    return validate(cfg)


def test_the_command_line_form_composes(two_files):
    a, b = two_files
    settings = _validate("data.path=null", f"data.mix=[{{path: {a}, weight: 2}}, {{path: {b}}}]")
    assert settings.data.mix == [{"path": str(a), "weight": 2}, {"path": str(b)}]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["data.mix=[{path: A, weight: 2}]"],
            "data.mix and data.path=",
        ),
        (["data.path=null", "data.mix=[]"], r"data.mix=\[\] lists no source"),
        (
            ["data.path=null", "data.mix=[{path: A, weight: 0}]"],
            r"data.mix\[0\].weight=0: must be a number > 0",
        ),
        (
            ["data.path=null", "data.mix=[{path: A, weight: 1}, {path: A, weight: -1}]"],
            r"data.mix\[1\].weight=-1: must be a number > 0",
        ),
        (
            ["data.path=null", "data.mix=[{path: ./no/such.jsonl, weight: 1}]"],
            r"data.mix\[0\].path=./no/such.jsonl: no such file or folder",
        ),
        (
            ["data.path=null", "data.mix=[{path: A, wieght: 2}]"],
            r"data.mix\[0\]: unknown key\(s\) wieght; an entry is \{path: ",
        ),
        (["data.path=null", "data.mix=[{weight: 2}]"], r"data.mix\[0\]: no path"),
        (
            ["data.path=null", "data.mix=[{path: A}, {path: A}]"],
            r"data.mix\[1\].path=.*: already data.mix\[0\]",
        ),
        (["data.path=null"], "data.path is not set"),
    ],
)
def test_bad_mix_is_refused_in_one_line(two_files, overrides, message):
    a, _ = two_files
    with pytest.raises(ConfigError, match=message) as err:
        _validate(*(o.replace("A", str(a)) for o in overrides))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_sft_trains_on_a_mix(tmp_path, two_files, cache_dir):
    a, b = two_files
    run = tmp_path / "run"
    proc = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "data.path=null",
        f"data.mix=[{{path: {a}, weight: 2}}, {{path: {b}, weight: 1}}]",
        "trainer.max_steps=2",
        "logger=none",
        "trainer.progress_bar=false",
        f"data.cache_dir={cache_dir}",
        f"output_dir={run}",
    )
    assert "data.mix[0]" in proc.stderr and "(weight 2)" in proc.stderr
    assert read_metrics(run)[-1]["step"] == 2
