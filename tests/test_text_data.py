"""Text and table data for the language-model and classification recipes: every source form,
the held-out split, packing, label mapping and the messages for data that cannot be used."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import make_task
from transformers import AutoTokenizer

from recipes.config import ASSETS, DataConfig
from recipes.data import DataError, load_splits

SHAKESPEARE = ASSETS / "text" / "tinyshakespeare.txt"
QNLI = ASSETS / "glue" / "qnli-squad"


def _data(tmp_path, **kwargs) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kwargs)


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-gpt2")


@pytest.fixture(scope="module")
def bert_tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tiny-bert")


def test_single_text_file_gets_a_seeded_reported_eval_split(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="recipes"):
        splits = load_splits(_data(tmp_path, path=str(SHAKESPEARE), sample_by="line"))
    train, held = splits["train"].examples, splits["eval"].examples
    lines = SHAKESPEARE.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(train) + len(held) == len(lines)
    assert len(held) == round(0.05 * len(lines))
    assert "holding out 500 of its 10000 examples" in caplog.text
    assert "data.eval_fraction=0.05" in caplog.text
    again = load_splits(_data(tmp_path, path=str(SHAKESPEARE), sample_by="line"))
    assert again["eval"].examples["text"] == held["text"]  # seeded: the same split every run
    other = load_splits(_data(tmp_path, path=str(SHAKESPEARE), split_seed=7))
    assert other["eval"].examples["text"] != held["text"]
    assert splits["train"].fingerprint != splits["eval"].fingerprint


def test_paragraphs_and_one_document_per_file(tmp_path):
    paragraphs = load_splits(_data(tmp_path, path=str(SHAKESPEARE), sample_by="paragraph"))
    n = sum(len(s.examples) for s in paragraphs.values())
    expected = [p for p in SHAKESPEARE.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    assert n == len(expected)

    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(20):
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}.\nIts second line.\n")
    docs = load_splits(_data(tmp_path, path=str(folder), sample_by="document", eval_fraction=0.1))
    assert len(docs["train"].examples) == 18 and len(docs["eval"].examples) == 2
    assert all(t.count("\n") == 2 for t in docs["train"].examples["text"])


def test_named_splits_in_a_folder_are_used_as_they_are(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.txt").write_text("one\ntwo\nthree\n")
    (folder / "validation.txt").write_text("four\n")
    splits = load_splits(_data(tmp_path, path=str(folder)))
    assert splits["train"].examples["text"] == ["one\n", "two\n", "three\n"]
    assert splits["eval"].examples["text"] == ["four\n"]


def test_json_lines_with_a_text_column_pack_into_full_blocks(tmp_path, gpt2_tokenizer):
    lines = SHAKESPEARE.read_text(encoding="utf-8").split("\n\n")[:400]
    path = tmp_path / "speeches.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(lines)))
    cfg = _data(tmp_path, path=str(path), text_column="body", eval_fraction=0.1)
    task = make_task("clm", block_size=64, add_eos_token=True)
    data = task.build_data(cfg, gpt2_tokenizer)
    assert set(data.train.column_names) == {"input_ids", "attention_mask"}
    assert {len(ids) for ids in data.train["input_ids"]} == {64}
    # Packing keeps every token of the training texts, in order, up to the dropped tail.
    train_texts = load_splits(cfg)["train"].examples["body"]
    stream = [t for text in train_texts for t in [*gpt2_tokenizer(text)["input_ids"], 0] if text]
    packed = [t for ids in data.train["input_ids"] for t in ids]
    assert packed == stream[: len(packed)] and len(stream) - len(packed) < 64 * 2

    with pytest.raises(DataError, match=r"data\.text_column"):
        task.build_data(_data(tmp_path, path=str(path), text_column="text"), gpt2_tokenizer)


def test_parquet_and_block_size_longer_than_the_data(tmp_path, gpt2_tokenizer):
    from datasets import Dataset

    path = tmp_path / "train.parquet"
    Dataset.from_dict({"text": ["short text"] * 30}).to_parquet(str(path))
    cfg = _data(tmp_path, path=str(path), eval_fraction=0.2)
    with pytest.raises(DataError, match=r"lower task\.block_size"):
        make_task("clm", block_size=128).build_data(cfg, gpt2_tokenizer)
    data = make_task("clm", block_size=8).build_data(cfg, gpt2_tokenizer)
    assert len(data.train) > 0 and len(data.eval) > 0


def test_no_eval_split_and_no_fraction_names_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"data\.eval_file=.*data\.eval_fraction=0\.05"):
        load_splits(_data(tmp_path, path=str(SHAKESPEARE), eval_fraction=0.0))


def test_masked_lm_eval_blocks_are_masked_once_the_same_way(tmp_path, bert_tokenizer):
    cfg = _data(tmp_path, path=str(SHAKESPEARE), sample_by="paragraph")
    first = make_task("mlm", block_size=64).build_data(cfg, bert_tokenizer)
    second = make_task("mlm", block_size=64).build_data(cfg, bert_tokenizer)
    assert first.eval["input_ids"] == second.eval["input_ids"]
    labels = [t for row in first.eval["labels"] for t in row]
    chosen = sum(t != -100 for t in labels) / len(labels)
    assert 0.10 < chosen < 0.20  # about 15 % of the tokens are predicted
    mask_id = bert_tokenizer.mask_token_id
    masked = [
        i == mask_id
        for ids, row in zip(first.eval["input_ids"], first.eval["labels"], strict=True)
        for i, t in zip(ids, row, strict=True)
        if t != -100
    ]
    assert 0.7 < sum(masked) / len(masked) < 0.9  # 80 % of those become [MASK]
    # Training batches are masked afresh by the collator.
    batch = first.train_collator([first.train[i] for i in range(8)])
    assert batch["input_ids"].shape == batch["labels"].shape == (8, 64)


def test_whole_word_masking_chooses_every_piece_of_a_word(tmp_path, bert_tokenizer):
    cfg = _data(tmp_path, path=str(SHAKESPEARE), sample_by="paragraph")
    data = make_task("mlm", block_size=64, whole_word_mask=True).build_data(cfg, bert_tokenizer)
    pieces = 0
    for ids, labels in zip(data.eval["input_ids"], data.eval["labels"], strict=True):
        for i in range(1, len(labels)):
            original = labels[i] if labels[i] != -100 else ids[i]
            if bert_tokenizer.convert_ids_to_tokens(original).startswith("##"):
                pieces += 1
                assert (labels[i] != -100) == (labels[i - 1] != -100)
    assert pieces > 100  # the check saw many multi-piece words


def test_glue_tsv_layout_and_label_names(tmp_path, bert_tokenizer):
    task = make_task("classification", max_seq_length=64)
    data = task.build_data(_data(tmp_path, path=str(QNLI), name="qnli"), bert_tokenizer)
    assert data.label_names == ["entailment", "not_entailment"]
    assert task.main_metric == "accuracy"
    rows = (QNLI / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]
    assert len(data.eval) == len(rows)
    expected = [0 if r.split("\t")[-1] == "entailment" else 1 for r in rows]
    assert data.eval["labels"] == expected
    assert task.model_kwargs(data)["id2label"] == {0: "entailment", 1: "not_entailment"}


def test_real_glue_files(tmp_path, shared_data, bert_tokenizer):
    mrpc = make_task("classification")
    folder = shared_data / "glue" / "MRPC"
    data = mrpc.build_data(_data(tmp_path, path=str(folder), name="mrpc"), bert_tokenizer)
    # Every line but the header is a pair: none is lost to the quotes inside sentences, and the
    # byte-order mark does not hide the first column's name.
    lines = [
        len((folder / f).read_text(encoding="utf-8").splitlines()) - 1
        for f in ("train.tsv", "dev.tsv")
    ]
    assert [len(data.train), len(data.eval)] == lines
    assert mrpc.main_metric == "f1" and sum(data.eval["labels"]) == 279  # 68 % positive

    stsb = make_task("classification")
    data = stsb.build_data(
        _data(tmp_path, path=str(shared_data / "glue" / "STS-B"), name="sts-b"), bert_tokenizer
    )
    assert data.label_names is None and stsb.model_kwargs(data)["problem_type"] == "regression"
    assert len(data.eval) == 1500 and 0 <= min(data.eval["labels"]) < max(data.eval["labels"]) <= 5


def test_custom_csv_labels_and_bad_labels(tmp_path, bert_tokenizer):
    good = tmp_path / "good"
    good.mkdir()
    (good / "train.csv").write_text("text,label\ngreat film,pos\nawful,neg\nfine,pos\n")
    (good / "dev.csv").write_text("text,label\nbad,neg\n")
    task = make_task("classification")
    data = task.build_data(_data(tmp_path, path=str(good)), bert_tokenizer)
    assert data.label_names == ["neg", "pos"] and data.train["labels"] == [1, 0, 1]

    (good / "dev.csv").write_text("text,label\nbad,meh\n")
    with pytest.raises(DataError, match="label 'meh' in column 'label' is not one of"):
        make_task("classification").build_data(
            _data(tmp_path / "other", path=str(good)), bert_tokenizer
        )
    with pytest.raises(DataError, match=r"data\.text_pair_column=nope: no such column"):
        make_task("classification").build_data(
            _data(tmp_path, path=str(good), text_pair_column="nope"), bert_tokenizer
        )
