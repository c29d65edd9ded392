"""The tokens ``task.loss_type=orpo`` and ``simpo`` train on, against TRL 1.16's ``ORPOTrainer``
and ``CPOTrainer`` tokenization (``tokenize_row``, in ``trl/experimental/orpo`` and
``trl/experimental/cpo``), pinning the row of docs/configuration.md's "Where our labels differ
from TRL 1.16" table: TRL renders a conversation with the template, then appends (and labels) an
EOS after the side's text and puts a BOS in front where the text has none; the project tokenizes
every preference loss as ``DPOTrainer`` does, the template's tokens and nothing more.

Rows: the first bundled held-out pairs (SQuAD answers against wrong spans), not written for this
test; zephyr's template, whose end of turn is the EOS followed by a newline (so TRL's side ends
with EOS, newline, EOS); and the same pairs as plain strings read as TRL reads them.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, make_task

from recipes.config import DataConfig, ModelConfig
from recipes.model import load_tokenizer
from recipes.tasks import chat

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")
from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

PAIRS = ROOT / "recipes/assets/preferences/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
PAIR_ROWS = [json.loads(line) for line in PAIRS.read_text().splitlines()[:8]]
TEXT_ROWS = [  # the same pairs as TRL's standard (plain-string) rows
    {k: r["prompt"][-1]["content"] if k == "prompt" else r[k][0]["content"] for k in r}
    for r in PAIR_ROWS
]
SIDES = ("chosen", "rejected")


def _ours(tmp_path, rows: list[dict], **task) -> tuple:
    """The tokenizer (with the template the task put on it) and the pairs' features."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo = make_task("dpo", max_seq_length=256, loss_type="orpo", **task)
    data = dpo.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    return tokenizer, data.train


def _trl(tokenizer, rows: list[dict]) -> list[dict]:
    """TRL's ORPO features of ``rows``, after checking that CPO's (SimPO's) are the same."""
    found = {}
    for trainer_class in (ORPOTrainer, CPOTrainer):
        trainer = object.__new__(trainer_class)  # tokenize_row reads only these
        vars(trainer).update(is_encoder_decoder=False, processing_class=tokenizer, max_length=256)
        found[trainer_class] = [
            trainer.tokenize_row(maybe_apply_chat_template(maybe_extract_prompt(r), tokenizer))
            for r in rows
        ]
    assert found[ORPOTrainer] == found[CPOTrainer]
    return found[ORPOTrainer]


def _labelled(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t, label in zip(ids, labels, strict=True) if label != chat.IGNORE_INDEX]


def test_orpo_and_simpo_label_the_templates_tokens_where_trl_adds_an_eos(tmp_path):
    tokenizer, ours = _ours(tmp_path, PAIR_ROWS, chat_template="zephyr")
    theirs = _trl(tokenizer, PAIR_ROWS)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for pair, our, their in zip(PAIR_ROWS, ours, theirs, strict=True):
        for side in SIDES:
            ids, labels = our[f"{side}_input_ids"], our[f"{side}_labels"]
            # Here: the template's rendering, token for token; labelled up to its end of turn.
            text = tokenizer.apply_chat_template(pair["prompt"] + pair[side], tokenize=False)
            assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
            last = max(i for i, label in enumerate(labels) if label != -100)
            assert ids[last] == eos and tokenizer.decode(ids[last + 1 :]).strip() == ""
            # TRL: a BOS in front, and after the template's end of turn (EOS and its newline)
            # one more EOS, labelled.
            assert their[f"{side}_input_ids"] == [bos, *ids, eos]
            extra = [*ids[last + 1 :], eos]
            assert _labelled(their[f"{side}_input_ids"], their[f"{side}_labels"]) == [
                *_labelled(ids, labels),
                *extra,
            ]
            assert _labelled(ids, labels).count(eos) == 1 and extra.count(eos) == 1


def test_on_plain_strings_trl_adds_only_an_unlabelled_bos(tmp_path):
    tokenizer, ours = _ours(tmp_path, TEXT_ROWS, text_rows="raw")
    theirs = _trl(tokenizer, TEXT_ROWS)
    for our, their in zip(ours, theirs, strict=True):
        for side in SIDES:
            ids, labels = our[f"{side}_input_ids"], our[f"{side}_labels"]
            assert ids[0] != tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
            assert their[f"{side}_input_ids"] == [tokenizer.bos_token_id, *ids]
            assert their[f"{side}_labels"] == [chat.IGNORE_INDEX, *labels]
