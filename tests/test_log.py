"""The run's output: transformers' load report becomes one line naming the new weights."""

from __future__ import annotations

import pytest
from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification

from recipes.config import ASSETS, ModelConfig
from recipes.log import setup_logging
from recipes.model import load_model


def _loaded(name: str, auto_class, capfd: pytest.CaptureFixture, **kwargs) -> list[str]:
    """The terminal's lines while the loop loads bundled model ``name`` with ``auto_class``
    (progress bars are off in runs: setup_logging)."""
    setup_logging(is_main_process=True)
    capfd.readouterr()
    load_model(ModelConfig(name_or_path=str(ASSETS / name)), auto_class, **kwargs)
    captured = capfd.readouterr()
    return (captured.out + captured.err).splitlines()


def test_a_new_head_is_named_in_one_line(capfd: pytest.CaptureFixture) -> None:
    # MiniLM has a QA head and no classifier: the classifier and the pooler it reads are new.
    (line,) = _loaded("minilm-squad", AutoModelForSequenceClassification, capfd, num_labels=3)
    assert line.endswith(
        "new weights, initialised at random: bert.pooler.dense.{bias,weight}, "
        "classifier.{bias,weight}"
    )
    assert "LOAD REPORT" not in line and "qa_outputs" not in line  # unused: expected, unsaid


def test_a_load_with_nothing_new_says_nothing(capfd: pytest.CaptureFixture) -> None:
    # tiny-bert carries every head its recipes use; the MLM and classifier heads go unused.
    assert _loaded("tiny-bert", AutoModelForQuestionAnswering, capfd) == []


@pytest.mark.slow
def test_a_wandb_run_ends_with_its_done_line(tmp_path, cache_dir):
    """wandb's closing report (about 30 lines of history, summary and, offline, the sync
    command) goes to the run's wandb/summary.log: the terminal's last line is the run's own."""
    from conftest import run_train

    run = tmp_path / "run"
    proc = run_train(
        "recipe=gpt2_clm",
        "debug=smoke",
        "logger=wandb",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=2",
        "trainer.progress_bar=false",
        "task.sample_prompt=null",
        f"output_dir={run}",
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "false", "WANDB_QUIET": "false"},
    )
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert " done: 2 steps in " in lines[-1], lines[-5:]
    assert not [x for x in lines if "Run summary" in x or "wandb sync" in x]
    report = (run / "wandb" / "summary.log").read_text()
    assert "Run summary:" in report and "final/perplexity" in report
    assert "wandb sync " in report  # offline: how to upload it later
