"""Bad input as a new user types it: one clear line, a non-zero exit, nothing on disk lost."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_train

from recipes.config import ASSETS

# Each case runs train.py in a fresh process, as a user does.
pytestmark = pytest.mark.slow

SMOKE = ("recipe=bert_squad", "debug=smoke", "logger=none", "trainer.progress_bar=false")


def _fails(*overrides: str, tmp_path) -> str:
    proc = run_train(*SMOKE, f"output_dir={tmp_path / 'run'}", *overrides, check=False)
    assert proc.returncode != 0
    return proc.stderr


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "model.name_or_path=./no/such/checkpoint",
            "model.name_or_path=./no/such/checkpoint: no such folder",
        ),
        ("data.path=./no/such/squad", "data.path=./no/such/squad: no such file or folder"),
        ("task.doc_stride=300", "task.doc_stride=300 must be smaller than task.max_seq_length=256"),
        (
            "+model.config_overrides.hidden_dropout=0.0",
            "model.config_overrides.hidden_dropout: BertConfig has no such field",
        ),
        (
            "trainer.per_device_train_batch_size=0",
            "trainer.per_device_train_batch_size=0: must be at least 1",
        ),
    ],
)
def test_bad_setting_gives_one_line(tmp_path, override, expected):
    stderr = _fails(override, tmp_path=tmp_path)
    assert f"error: {expected}" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "override,expected",
    [
        ("recipe=bert_sqad", ["recipe=bert_sqad: must be one of", "bert_squad, bert_squad_v2"]),
        ("trainer.num_epoch=3", ["trainer.num_epoch=3: ", "did you mean trainer.num_epochs=3?"]),
        ("trainer.padding=max", ["trainer.padding=max: must be one of longest, max_length"]),
        ("trainer.max_stepz=5", ["did you mean trainer.max_steps=5?"]),
        ("trainer.max_steps=abc", ["trainer.max_steps=abc: must be an integer"]),
        ("peft=lorra", ["peft=lorra: must be one of lora, none", "did you mean peft=lora?"]),
        ("mixed_precision=fp8", ["did you mean trainer.mixed_precision=fp8?"]),
        ("trainer.mixed_precision=fp8", ["must be one of auto, no, fp16, bf16"]),
    ],
)
def test_what_hydra_cannot_compose_gives_one_line_and_exit_2(tmp_path, override, expected):
    """A misspelt key or option or a wrong type: Hydra's own report is several lines and exit
    code 1; train.py says it in one line, with the nearest valid name, and exits 2."""
    proc = run_train(*SMOKE, f"output_dir={tmp_path / 'run'}", override, check=False)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: ")
    for part in expected:
        assert part in line


def test_setting_that_torch_would_refuse_after_the_model_loads_is_refused_first(tmp_path):
    for override, expected in [
        ("trainer.max_steps=-5", "error: trainer.max_steps=-5: must be > 0"),
        ("optimizer.lr=-1e-3", "error: optimizer.lr=-0.001: must be a number >= 0"),
        ("optimizer.lr=abc", "error: optimizer.lr=abc: must be a number >= 0"),
    ]:
        proc = run_train(*SMOKE, f"output_dir={tmp_path / 'run'}", override, check=False)
        assert proc.returncode == 2
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(expected)
        assert not (tmp_path / "run").exists()


def test_a_model_given_with_debug_smoke_is_the_one_that_trains():
    proc = run_train("recipe=bert_squad", "debug=smoke", "model=bert_base_uncased", "--cfg", "job")
    composed = yaml.safe_load(proc.stdout)
    assert composed["model"]["name_or_path"] == "bert-base-uncased"
    assert composed["data"]["path"] == "${data.sample}"  # the smoke run's data
    proc = run_train("recipe=bert_squad", "debug=smoke", "--cfg", "job")
    assert yaml.safe_load(proc.stdout)["model"]["name_or_path"] == "${asset:minilm-squad}"


def test_malformed_squad_file_names_the_question(tmp_path):
    raw = json.loads((ASSETS / "squad" / "v1" / "train.json").read_text())
    qa = raw["data"][0]["paragraphs"][0]["qas"][0]
    qa["answers"][0]["answer_start"] += 7
    bad = tmp_path / "train-v1.1.json"
    bad.write_text(json.dumps(raw))
    stderr = _fails(
        f"data.train_file={bad}", f"data.cache_dir={tmp_path / 'cache'}", tmp_path=tmp_path
    )
    assert f"id {qa['id']}: answers.answer_start[0]" in stderr
    assert "Traceback" not in stderr


def test_finished_run_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    stderr = _fails(tmp_path=tmp_path)
    assert "already holds a run" in stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_predictions_are_never_overwritten_and_mlm_does_not_predict(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text('{"rows": 3}\n')
    (run / "predictions.json").write_text("{}\n")
    rows = ASSETS / "squad" / "v1" / "dev.json"
    stderr = _fails("mode=predict", f"data.predict_file={rows}", tmp_path=tmp_path)
    assert "already holds a run (results.json)" in stderr
    assert sorted(p.name for p in run.iterdir()) == ["predictions.json", "results.json"]
    proc = run_train(
        "recipe=bert_mlm",
        "debug=smoke",
        "logger=none",
        "mode=predict",
        f"data.predict_file={rows}",
        f"output_dir={tmp_path / 'mlm'}",
        check=False,
    )
    assert proc.returncode == 2
    assert "error: mode=predict: task=MaskedLanguageModeling has no predictions" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "recipe,override,expected",
    [
        ("gpt2_clm", "data.text_column=body", "no column 'body'"),
        ("gpt2_clm", "task.block_size=4096", "task.block_size=4096 is longer than the model's"),
        ("bert_glue", "data.label_column=score", "data.label_column=score: no such column"),
        ("bert_mlm", "data.eval_fraction=0", "data.eval_fraction=0"),
    ],
)
def test_bad_data_for_the_new_recipes_gives_one_line(tmp_path, recipe, override, expected):
    proc = run_train(
        f"recipe={recipe}",
        "debug=smoke",
        "logger=none",
        f"output_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        override,
        check=False,
    )
    assert proc.returncode == 2
    assert expected in proc.stderr.splitlines()[-1]
    assert "Traceback" not in proc.stderr


def _broken_squad(tmp_path, mutate) -> str:
    raw = json.loads((ASSETS / "squad" / "v1" / "train.json").read_text())
    mutate(raw)
    bad = tmp_path / "train-v1.1.json"
    bad.write_text(json.dumps(raw))
    return f"data.train_file={bad}"


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda raw: raw["data"][0]["paragraphs"][0].update(context=""), "empty context"),
        (lambda raw: raw["data"][0]["paragraphs"][0]["qas"][0].pop("answers"), "lacks answers"),
        (lambda raw: raw.update(data=[]), "holds no examples. Point data.train_file at"),
    ],
)
def test_broken_or_empty_squad_file_gives_one_line(tmp_path, mutate, expected):
    stderr = _fails(
        _broken_squad(tmp_path, mutate), f"data.cache_dir={tmp_path / 'cache'}", tmp_path=tmp_path
    )
    assert expected in stderr.splitlines()[-1]
    assert "Traceback" not in stderr


def test_resume_of_nothing_or_of_a_finished_run_is_refused(tmp_path):
    stderr = _fails(f"resume={tmp_path / 'no-such-run'}", tmp_path=tmp_path)
    assert "no-such-run: no such folder" in stderr.splitlines()[-1]
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    stderr = _fails("resume=auto", tmp_path=tmp_path)
    assert "already holds a finished run (final/)" in stderr.splitlines()[-1]
    assert (run / "final" / "config.json").read_text() == "{}"


def test_a_run_leaves_no_folder_beside_its_own(tmp_path, cache_dir):
    """Hydra's run folder is the run's own: a run, an evaluation and a sweep given output_dir
    make nothing under outputs/ or multirun/ (one afternoon of runs once left 62 empty
    outputs/<recipe>/<date_time>/ folders); a refused run leaves no folder at all."""
    gpt2 = (
        "recipe=gpt2_clm",
        "debug=smoke",
        "logger=none",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=1",
        "trainer.progress_bar=false",
        "task.sample_prompt=null",
    )
    run_train(*gpt2, "output_dir=run", cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    run_train(*gpt2, "mode=eval", "model.name_or_path=run/final", "output_dir=scored", cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "scored"]

    refused = run_train(*gpt2, "trainer.max_steps=-5", cwd=tmp_path, check=False)
    assert refused.returncode == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "scored"]  # no outputs/

    run_train("-m", *gpt2, "trainer.seed=1,2", "output_dir=sweep", cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "scored", "sweep"]
    sweep = tmp_path / "sweep"
    assert (sweep / "summary.md").is_file()
    assert all((sweep / job / "results.json").is_file() for job in ("0", "1"))
    swept = run_train("-m", *gpt2, "output_dir=a,b", cwd=tmp_path, check=False)
    assert swept.returncode == 2
    [line] = swept.stderr.strip().splitlines()
    assert line.startswith("error: output_dir cannot be swept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "scored", "sweep"]
