"""``model.attention_dropout`` and ``model.config_overrides`` reach the loaded model, whatever
the architecture calls the field, and a field the model does not have is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForQuestionAnswering, T5Config

from recipes import adapters
from recipes.config import ASSETS, ConfigError, ModelConfig, peft_settings
from recipes.model import config_overrides, load_model, weights_summary


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


def _bf16_checkpoint(tmp_path) -> str:
    """The tiny Llama saved in bf16, as most LLM checkpoints ship."""
    model = AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    return str(tmp_path / "bf16")


def test_a_bf16_checkpoint_trains_on_fp32_master_weights_unless_asked(tmp_path):
    path = _bf16_checkpoint(tmp_path)
    model = load_model(ModelConfig(name_or_path=path), AutoModelForCausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    summary = weights_summary(model, ModelConfig(name_or_path=path), "bf16")
    assert summary == "weights: trainable in float32 (model.dtype=float32); autocast: bf16"

    as_saved = ModelConfig(name_or_path=path, dtype="auto")
    assert {p.dtype for p in load_model(as_saved, AutoModelForCausalLM).parameters()} == {
        torch.bfloat16
    }
    pure = ModelConfig(name_or_path=path, dtype="bfloat16")
    summary = weights_summary(load_model(pure, AutoModelForCausalLM), pure, "no")
    assert summary.startswith("weights: trainable in bfloat16 (model.dtype=bfloat16)")
    assert "Pure low-precision training" in summary


def test_lora_keeps_a_bf16_base_frozen_and_trains_fp32_adapters_when_asked(tmp_path):
    cfg = ModelConfig(name_or_path=_bf16_checkpoint(tmp_path), dtype="bfloat16")
    lora = peft_settings({"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0})
    model = adapters.apply_lora(load_model(cfg, AutoModelForCausalLM), lora, [])
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert (trainable, frozen) == ({torch.float32}, {torch.bfloat16})
    assert weights_summary(model, cfg, "bf16") == (
        "weights: trainable in float32, frozen in bfloat16 (model.dtype=bfloat16); autocast: bf16"
    )


def test_fp16_trainable_weights_under_the_fp16_scaler_are_refused(tmp_path):
    cfg = ModelConfig(name_or_path=str(ASSETS / "tiny-llama"), dtype="float16")
    model = load_model(cfg, AutoModelForCausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    with pytest.raises(
        ConfigError, match=r"^model.dtype=float16 with trainer.mixed_precision=fp16"
    ):
        weights_summary(model, cfg, "fp16")
