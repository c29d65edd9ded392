"""The model presets of the families users fine-tune (conf/model/<name>.yaml, docs/models.md):
each composes with every chat recipe and names a hub model whose real shape
recipes/model_shapes.py keeps (the memory plan and the reduced-depth tests build from it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes.config import register_resolvers
from recipes.model_shapes import SHAPES, reduced

CONF = Path(__file__).resolve().parents[1] / "conf"
PRESETS = {
    "qwen3_0_6b": "Qwen/Qwen3-0.6B",
    "qwen3_4b": "Qwen/Qwen3-4B",
    "qwen3_8b": "Qwen/Qwen3-8B",
    "qwen3_14b": "Qwen/Qwen3-14B",
    "qwen3_32b": "Qwen/Qwen3-32B",
    "qwen3_30b_a3b": "Qwen/Qwen3-30B-A3B",
    "qwen2_5_7b_instruct": "Qwen/Qwen2.5-7B-Instruct",
    "llama3_1_8b_instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "gemma3_4b_it": "google/gemma-3-4b-it",
    "glm4_9b_chat": "THUDM/glm-4-9b-chat-hf",
    "deepseek_r1_distill_qwen_7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
}
CHAT_RECIPES = ("llama_sft", "llama_dpo", "llama_kto", "llama_grpo", "llama_rm", "llama_gkd")

register_resolvers()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/unused", *overrides])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_composes_with_its_hub_model(preset: str) -> None:
    """Every preset names its hub model in bf16 (composed with one chat recipe and LoRA: the
    model group is the same under every recipe, and composing costs about a second)."""
    recipe = CHAT_RECIPES[sorted(PRESETS).index(preset) % len(CHAT_RECIPES)]
    cfg = _compose(f"recipe={recipe}", f"model={preset}", "peft=lora")
    assert cfg.model.name_or_path == PRESETS[preset]
    assert cfg.model.dtype == "bfloat16" and cfg.model.gguf_file is None
    assert PRESETS[preset] in SHAPES


def test_every_preset_file_is_listed() -> None:
    """Every conf/model file of a model with a kept shape has a row here and in docs."""
    named = {
        p.stem: line.split(":", 1)[1].split("#")[0].strip()
        for p in (CONF / "model").glob("*.yaml")
        for line in p.read_text().splitlines()
        if line.startswith("name_or_path:")
    }
    assert {stem for stem, hub in named.items() if hub in SHAPES} == set(PRESETS)
    docs = (CONF.parent / "docs" / "models.md").read_text()
    assert all(f"model={preset}" in docs for preset in PRESETS)


def test_reduced_keeps_width_and_cuts_depth() -> None:
    shape = reduced("Qwen/Qwen3-30B-A3B", 1, num_experts=8)
    assert shape["num_hidden_layers"] == 1 and shape["num_experts"] == 8
    assert shape["hidden_size"] == SHAPES["Qwen/Qwen3-30B-A3B"]["hidden_size"]
    assert SHAPES["Qwen/Qwen3-30B-A3B"]["num_experts"] == 128  # the kept shape is untouched
