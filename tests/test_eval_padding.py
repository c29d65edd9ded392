"""``mode=eval`` pads its batches as the evaluations during training do:
``trainer.pad_to_multiple_of`` reaches the task's own collators in both (token classification's,
here). Both runs are in this process (Hydra's compose API and the ``run`` that train.py calls),
on bert_ner's smoke model (the bundled small MiniLM) and a few rows."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FP32, ROOT
from hydra import compose, initialize_config_dir

from recipes import data as data_lib
from recipes import evaluation
from recipes.config import register_resolvers, validate
from recipes.modes import run
from recipes.session import _reset_accelerate

# Longer than any row of the smoke NER data (task.max_seq_length=48): only padding reaches it.
MULTIPLE = 64
SMOKE = (
    "recipe=bert_ner",
    "debug=smoke",
    "logger=none",
    "trainer.progress_bar=false",
    FP32,
    "data.max_train_examples=8",
    "trainer.per_device_train_batch_size=8",
    "data.max_eval_examples=16",
    "trainer.per_device_eval_batch_size=8",
    f"trainer.pad_to_multiple_of={MULTIPLE}",
)


class _Widths:
    """An evaluation's loader that notes each batch's length (what the collator padded to)."""

    def __init__(self, loader: Any, widths: list[int]) -> None:
        self.loader, self.widths = loader, widths

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self.widths.append(batch["input_ids"].shape[-1])
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@pytest.fixture
def run_logging() -> Iterator[None]:
    """The ``recipes`` logger as it was before the runs (a run routes it to its own train.log
    and stops it propagating, which the other tests' ``caplog`` relies on), and the data's
    progress bars (the smoke runs turn them off for the process: trainer.progress_bar)."""
    logger = logging.getLogger("recipes")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    progress = data_lib.progress_enabled()
    yield
    data_lib.show_progress(progress)
    for handler in logger.handlers:
        if handler not in handlers:
            handler.close()
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level


def _run(output_dir: Path, *overrides: str) -> None:
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*SMOKE, *overrides, f"output_dir={output_dir}"])
    try:
        run(validate(cfg))
    finally:
        _reset_accelerate()  # the next run builds its own Accelerator


def _eval_widths(monkeypatch) -> list[int]:
    """The lengths of the batches every evaluation from now on reads."""
    widths: list[int] = []
    scored = evaluation.evaluate

    def evaluate(task, model, loader, data, run_context):
        return scored(task, model, _Widths(loader, widths), data, run_context)

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    return widths


@pytest.mark.slow  # a training run, then mode=eval
@pytest.mark.usefixtures("run_logging")
def test_eval_mode_pads_as_evaluation_during_training(tmp_path, cache_dir, monkeypatch):
    cache = f"data.cache_dir={cache_dir}"
    trained = tmp_path / "run"
    with monkeypatch.context() as patched:
        during_training = _eval_widths(patched)
        _run(trained, cache, "trainer.max_steps=1", "trainer.eval_at_start=false")
    with monkeypatch.context() as patched:
        eval_mode = _eval_widths(patched)
        _run(tmp_path / "eval", cache, "mode=eval", f"model.name_or_path={trained / 'final'}")
    assert during_training and eval_mode
    assert all(width % MULTIPLE == 0 for width in during_training), during_training
    assert all(width % MULTIPLE == 0 for width in eval_mode), eval_mode
