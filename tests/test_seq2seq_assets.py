"""The bundled tiny T5 and seq2seq data slices load offline and have the expected layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ASSETS = Path(__file__).resolve().parent.parent / "recipes/assets"


def test_tiny_t5_has_t5s_tokenizer_and_special_ids():
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-t5")
    assert tokenizer.is_fast
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    # t5-small's ids: "Hello" 8774, "world" 296, then </s>; the sentinels sit at the top.
    assert tokenizer("Hello world")["input_ids"] == [8774, 296, 1]
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == 32099
    model, info = AutoModelForSeq2SeqLM.from_pretrained(
        ASSETS / "tiny-t5", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(model).__name__ == "T5ForConditionalGeneration"
    assert str(next(model.parameters()).dtype) == "torch.float32"
    assert model.config.vocab_size == len(tokenizer) == 32100
    assert model.generation_config.decoder_start_token_id == 0
    assert model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()


@pytest.mark.parametrize("split", ["train", "dev"])
def test_scitldr_rows(split):
    lines = (ASSETS / "scitldr" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == {"train": 300, "dev": 619}[split]
    for row in rows:
        assert set(row) == {"source", "target", "targets"}
        assert row["source"] and row["target"] == row["targets"][0]


def test_tatoeba_rows_and_splits_share_no_source():
    def read(split: str) -> list[dict]:
        path = ASSETS / "tatoeba-en-de" / f"{split}.jsonl"
        return [json.loads(line)["translation"] for line in path.read_text("utf-8").splitlines()]

    train, dev = read("train"), read("dev")
    assert (len(train), len(dev)) == (5000, 500)
    assert all(set(row) == {"en", "de"} and row["en"] and row["de"] for row in train + dev)
    assert not {row["en"] for row in train} & {row["en"] for row in dev}
