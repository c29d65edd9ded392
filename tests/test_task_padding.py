"""trainer.padding=max_length reaches the collators of the tasks that bring their own (token
classification, multiple choice, seq2seq): every batch is padded to the task's length, as the
default collator pads the other tasks'; trainer.pad_to_multiple_of still rounds the longest."""

from __future__ import annotations

import pytest
from conftest import ROOT
from transformers import AutoTokenizer, DataCollatorForTokenClassification

from recipes.session import pad_task_batches
from recipes.tasks.base import TaskData
from recipes.tasks.multiple_choice import MultipleChoiceCollator
from recipes.tasks.seq2seq import Seq2SeqCollator

TOKENIZER = ROOT / "recipes" / "assets" / "tiny-bert"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def _batches(tokenizer, fixed, multiple=None):
    ner = DataCollatorForTokenClassification(tokenizer, label_pad_token_id=-100)
    choice = MultipleChoiceCollator(tokenizer)
    seq2seq = Seq2SeqCollator(tokenizer.pad_token_id)
    for collator in (ner, choice, seq2seq):
        pad_task_batches(TaskData([], [], collator, collator), multiple, fixed)
    ids = tokenizer(["a short row", "a row with a few more words in it"])["input_ids"]
    return (
        ner([{"input_ids": i, "labels": [0] * len(i)} for i in ids]),
        choice([{"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}]),
        seq2seq([{"input_ids": i, "labels": i[:3]} for i in ids]),
    )


def test_max_length_pads_every_task_collator_to_the_task_length(tokenizer):
    ner, choice, seq2seq = _batches(tokenizer, fixed=32)
    assert ner["input_ids"].shape == ner["labels"].shape == (2, 32)
    assert (ner["labels"][:, -1] == -100).all()
    assert choice["input_ids"].shape == choice["attention_mask"].shape == (1, 2, 32)
    assert seq2seq["input_ids"].shape == seq2seq["attention_mask"].shape == (2, 32)
    assert seq2seq["labels"].shape == (2, 3)  # targets keep their own length


def test_longest_rounds_to_the_multiple_without_a_fixed_length(tokenizer):
    ner, choice, seq2seq = _batches(tokenizer, fixed=None, multiple=8)
    longest = max(len(i) for i in tokenizer(["a row with a few more words in it"])["input_ids"])
    width = -(-longest // 8) * 8
    assert ner["input_ids"].shape[1] == choice["input_ids"].shape[2] == width
    assert seq2seq["input_ids"].shape[1] == width
