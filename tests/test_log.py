"""The run's output: the bundled tiny models' expected load reports are dropped, others kept."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import transformers

from recipes.config import ASSETS
from recipes.log import setup_logging

TINY_BERT = ASSETS / "tiny-bert"


def _load_report(source: Path, caplog: pytest.LogCaptureFixture) -> str:
    """What transformers logs while loading ``source`` as a classifier (the MLM and QA heads of
    tiny-bert go unused), as a run after ``setup_logging`` sees it."""
    setup_logging(is_main_process=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="transformers"):
        transformers.AutoModelForSequenceClassification.from_pretrained(str(source), num_labels=2)
    return "\n".join(record.getMessage() for record in caplog.records)


def test_bundled_checkpoint_unused_heads_are_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert "qa_outputs" not in _load_report(TINY_BERT, caplog)


def test_other_checkpoints_are_still_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    copy = shutil.copytree(TINY_BERT, tmp_path / "tiny-bert")
    assert "qa_outputs" in _load_report(copy, caplog)
