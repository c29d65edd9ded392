"""``model.attention_dropout`` and ``model.config_overrides`` reach the loaded model, whatever
the architecture calls the field, and a field the model does not have is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForQuestionAnswering, T5Config

from recipes.config import ASSETS, ConfigError, ModelConfig
from recipes.model import config_overrides, load_model


@pytest.mark.parametrize(
    "asset,field",
    [
        ("tiny-bert", "attention_probs_dropout_prob"),
        ("tiny-gpt2", "attn_pdrop"),
        ("tiny-llama", "attention_dropout"),
    ],
)
def test_attention_dropout_finds_each_architectures_field(asset, field):
    cfg = ModelConfig(name_or_path=str(ASSETS / asset), attention_dropout=0.0)
    auto = AutoModelForQuestionAnswering if asset == "tiny-bert" else AutoModelForCausalLM
    model = load_model(cfg, auto, config_overrides(cfg))
    assert getattr(model.config, field) == 0.0
    assert config_overrides(ModelConfig(name_or_path=str(ASSETS / asset))) == {}


def _train_mode_logits(cfg: ModelConfig) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = load_model(cfg, AutoModelForQuestionAnswering, config_overrides(cfg)).train()
    ids = torch.randint(5, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        return [model(input_ids=ids).start_logits for _ in range(2)]


def test_no_dropout_makes_training_forward_passes_equal():
    path = str(ASSETS / "tiny-bert")
    first, second = _train_mode_logits(ModelConfig(name_or_path=path))
    assert not torch.equal(first, second)  # dropout on: two passes differ
    off = ModelConfig(
        name_or_path=path,
        attention_dropout=0.0,
        config_overrides={"hidden_dropout_prob": 0.0},
    )
    first, second = _train_mode_logits(off)
    assert torch.equal(first, second)


def test_a_field_the_model_lacks_is_refused_by_name(tmp_path):
    cfg = ModelConfig(name_or_path=str(ASSETS / "tiny-bert"), config_overrides={"attn_pdrop": 0})
    with pytest.raises(ConfigError) as err:
        config_overrides(cfg)
    assert str(err.value).startswith("model.config_overrides.attn_pdrop: BertConfig has no")
    assert "hidden_dropout_prob, attention_probs_dropout_prob" in str(err.value)

    T5Config(d_model=8, d_ff=8, num_layers=1, num_heads=1, d_kv=8).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        config_overrides(ModelConfig(name_or_path=str(tmp_path), attention_dropout=0.0))
    message = str(err.value)
    assert message.startswith("model.attention_dropout=0.0: T5Config has no attention-dropout")
    assert "dropout_rate" in message and "model.attention_dropout=null" in message
