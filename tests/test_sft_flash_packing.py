"""Packed rows under flash attention: the kernels get no mask, so transformers must read the
conversation boundaries from ``position_ids``, which it does only for a batch of one row.

No flash kernel runs on a CPU. These tests check what transformers' own code reads from the
inputs the task passes (``_is_packed_sequence``, ``prepare_fa_kwargs_from_position_ids``), and
run the tiny Llama with an attention function that computes what flash-attention's
variable-length kernel computes from those boundaries (causal attention within each sequence),
so packed conversations must score as they do alone."""

from __future__ import annotations

import itertools

import pytest
import torch
from datasets import Dataset
from test_sft import _conversation_features, _tiny_llama, tokenizer  # noqa: F401

from recipes.tasks import chat
from recipes.tasks.chat import forward, padding_free, token_losses

fa = pytest.importorskip("transformers.modeling_flash_attention_utils")
if not hasattr(fa, "_is_packed_sequence") or not hasattr(fa, "prepare_fa_kwargs_from_position_ids"):
    pytest.skip("this transformers reads packed sequences otherwise", allow_module_level=True)
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import repeat_kv  # noqa: E402


def _varlen_causal(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """flash_attn_varlen_func's result where transformers' flash path finds packed sequences
    (causal within each), else flash's plain causal attention; ``attention_mask`` is ignored as
    the packed path has none. Shapes as transformers' attention functions take them."""
    batch, _, length, _ = query.shape
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    bounds = [0, length]
    if fa._is_packed_sequence(position_ids, batch):
        bounds = fa.prepare_fa_kwargs_from_position_ids(position_ids)[0][0].tolist()
    out = torch.empty_like(query)
    for start, end in itertools.pairwise(bounds):
        out[:, :, start:end] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=kwargs.get("scaling"),
        )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("varlen_causal", _varlen_causal)


def _packed_batch(tokenizer):  # noqa: F811
    features = _conversation_features(tokenizer, 6)
    packed = Dataset.from_dict(chat.packed_rows(Dataset.from_list(features), capacity=512))
    assert len(packed) > 1  # a batch of several packed rows, each holding several conversations
    batch = chat.ChatCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)(list(packed))
    return features, batch


def test_the_flash_path_reads_each_conversation_as_a_sequence(tokenizer):  # noqa: F811
    features, batch = _packed_batch(tokenizer)
    rows, length = batch["input_ids"].shape
    # As the packed rows come from the collator, transformers reads them as plain sequences.
    assert not fa._is_packed_sequence(batch["position_ids"], rows)
    flat = padding_free({k: v for k, v in batch.items() if k != "labels"})
    assert flat["input_ids"].shape == (1, rows * length)
    assert fa._is_packed_sequence(flat["position_ids"], 1)
    starts = fa.prepare_fa_kwargs_from_position_ids(flat["position_ids"])[0][0].tolist()
    # Every conversation starts a sequence; row padding (position 0) adds one-token ones.
    lengths = [b - a for a, b in itertools.pairwise(starts)]
    padding = rows * length - sum(len(f["input_ids"]) for f in features)
    assert sorted(n for n in lengths if n > 1) == sorted(len(f["input_ids"]) for f in features)
    assert lengths.count(1) == padding + sum(len(f["input_ids"]) == 1 for f in features)


def test_packed_conversations_score_as_they_do_alone_under_varlen_attention(tokenizer):  # noqa: F811
    features, batch = _packed_batch(tokenizer)
    model = _tiny_llama("varlen_causal")
    with torch.no_grad():  # as a model loaded with flash attention runs it
        out = forward(model, batch, attention="flash_attention_2")
        nll, count = token_losses(out.logits, batch["labels"])
    collate = chat.ChatCollator(tokenizer.pad_token_id)
    alone_nll, alone_count = torch.zeros(()), torch.zeros(())
    for feature in features:
        single = collate([feature])
        with torch.no_grad():
            out = _tiny_llama("sdpa")(
                input_ids=single["input_ids"], attention_mask=single["attention_mask"]
            )
        row_nll, row_count = token_losses(out.logits, single["labels"])
        alone_nll, alone_count = alone_nll + row_nll.sum(), alone_count + row_count.sum()
    assert count.sum() == alone_count
    torch.testing.assert_close(nll.sum(), alone_nll, atol=1e-3, rtol=1e-5)
