"""``mode=eval`` / ``mode=predict`` refuse a model whose config.json says it has another task's
head, or a head of another size, for every task: a reward model's final/ under task=sft was
scored as a causal LM (``loss=7.607, perplexity=2011``) without a word."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ROOT, make_task, run_train
from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

from recipes.model import head_mismatch
from recipes.tasks.configs import config_classes

TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"

# Per head class: a model type, the class it builds for it, and a head of that type that
# another task trains.
OWN_AND_OTHER = {
    "AutoModelForCausalLM": ("llama", "LlamaForCausalLM", "LlamaForSequenceClassification"),
    "AutoModelForSequenceClassification": (
        "llama",
        "LlamaForSequenceClassification",
        "LlamaForCausalLM",
    ),
    "AutoModelForSeq2SeqLM": ("t5", "T5ForConditionalGeneration", "T5ForSequenceClassification"),
    "AutoModelForMaskedLM": ("bert", "BertForMaskedLM", "BertForQuestionAnswering"),
    "AutoModelForQuestionAnswering": ("bert", "BertForQuestionAnswering", "BertForMaskedLM"),
    "AutoModelForTokenClassification": ("bert", "BertForTokenClassification", "BertForMaskedLM"),
    "AutoModelForMultipleChoice": (
        "bert",
        "BertForMultipleChoice",
        "BertForSequenceClassification",
    ),
}


@pytest.mark.parametrize("name", sorted(config_classes()))
def test_every_tasks_head_is_checked_against_the_saved_architecture(name):
    """Per task: a model saved with the head its auto class builds is scored; one saved with
    another task's head is refused, naming both; a pre-training head, which no task trains, is
    left to the weights' check."""
    auto = make_task(name).auto_model_class
    model_type, own, other = OWN_AND_OTHER[auto.__name__]
    assert head_mismatch(AutoConfig.for_model(model_type, architectures=[own]), auto) is None
    saved, scored = head_mismatch(AutoConfig.for_model(model_type, architectures=[other]), auto)
    assert other in saved and own in scored and auto.__name__ in scored
    pretraining = AutoConfig.for_model("bert", architectures=["BertForPreTraining"])
    assert head_mismatch(pretraining, auto) is None


def test_a_head_of_another_size_is_refused():
    """The reward model scores one output: a 2-label classifier of the same class is not one."""
    config = AutoConfig.for_model("llama", architectures=["LlamaForSequenceClassification"])
    auto = make_task("reward_model").auto_model_class
    config.num_labels = 2
    assert head_mismatch(config, auto, num_labels=1) == (
        "a LlamaForSequenceClassification with num_labels=2",
        "one with num_labels=1",
    )
    config.num_labels = 1
    assert head_mismatch(config, auto, num_labels=1) is None


@pytest.fixture(scope="module")
def reward_final(tmp_path_factory):
    """A reward model's final/ as llama_rm writes it: the tiny Llama with a one-output score
    head, recipe.json, and the run's results.json beside it."""
    run = tmp_path_factory.mktemp("rm-run")
    final = run / "final"
    config = AutoConfig.from_pretrained(TINY_LLAMA, num_labels=1, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(final)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(final)
    target = config_classes()["reward_model"]._target_
    (final / "recipe.json").write_text(json.dumps({"task": {"_target_": target}}))
    (run / "results.json").write_text(json.dumps({"overrides": ["recipe=llama_rm"]}))
    return final


@pytest.mark.parametrize("mode", ["eval", "predict"])
def test_a_reward_models_final_is_refused_by_sft(tmp_path, cache_dir, reward_final, mode):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": "Who came?"}) + "\n")
    proc = run_train(
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        f"mode={mode}",
        f"model.name_or_path={reward_final}",
        f"data.predict_file={rows}",
        f"output_dir={tmp_path / 'scored'}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    line = errors[0]
    assert f"error: mode={mode}: model.name_or_path={reward_final} is a " in line
    assert "LlamaForSequenceClassification (AutoModelForSequenceClassification)" in line
    assert "task=sft scores LlamaForCausalLM (AutoModelForCausalLM)" in line
    assert "(recipe=llama_rm, task=reward_model)" in line
    assert not (tmp_path / "scored" / "results.json").exists()


def test_a_model_that_names_no_head_is_checked_by_its_weights(tmp_path):
    """MiniLM's QA folder with no ``architectures`` in its config.json: the masked-LM head it
    lacks is found when its weights load, and refused as before."""
    folder = tmp_path / "minilm"
    shutil.copytree(ROOT / "recipes/assets/minilm-squad", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    proc = run_train(
        "recipe=bert_mlm",
        "debug=smoke",
        "logger=none",
        "mode=eval",
        f"model.name_or_path={folder}",
        f"output_dir={tmp_path / 'scored'}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("error: "))
    assert "lacks weights this task needs (new weights, initialised at random:" in line
