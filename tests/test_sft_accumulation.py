"""Every assistant token weighs the same in the gradient, however the tokens of an optimizer
step fall into micro-batches and processes: one process with the whole batch, one with four
accumulated micro-batches and four processes train alike (as transformers' Trainer and TRL do
with ``num_items_in_batch``). The bundled conversations differ in length, so the micro-batches
carry different numbers of assistant tokens; a per-micro-batch mean would weigh them wrongly."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_metrics, run_torchrun, run_train

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 16


def _run(run: Path, cache: Path, per_device: int, accumulation: int) -> tuple[str, ...]:
    return (
        "recipe=llama_sft",
        "debug=smoke",
        "logger=none",
        f"output_dir={run}",
        f"data.cache_dir={cache}",
        "task.num_generations=0",
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=0",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        "trainer.progress_bar=false",
        f"trainer.per_device_train_batch_size={per_device}",
        f"trainer.gradient_accumulation_steps={accumulation}",
    )


def _steps(run: Path) -> list[tuple[float, float]]:
    return [(m["train/loss"], m["train/grad_norm"]) for m in read_metrics(run) if "train/loss" in m]


def test_accumulation_and_processes_give_the_full_batch_gradient(tmp_path, cache_dir):
    whole, accumulated, four = tmp_path / "whole", tmp_path / "accumulated", tmp_path / "four"
    run_train(*_run(whole, cache_dir, GLOBAL_BATCH, 1))
    run_train(*_run(accumulated, cache_dir, GLOBAL_BATCH // 4, 4))
    proc = run_torchrun(*_run(four, cache_dir, GLOBAL_BATCH // 4, 1), processes=4)
    assert proc.returncode == 0, proc.stderr[-3000:]

    expected = _steps(whole)
    assert len(expected) == 4
    for run in (accumulated, four):
        # The loss is the step's assistant-token mean, and the gradient norm (before clipping)
        # that of the full batch's; equal steps keep the weights equal, so later steps match too.
        assert [loss for loss, _ in _steps(run)] == pytest.approx(
            [e[0] for e in expected], rel=1e-5
        )
        assert [norm for _, norm in _steps(run)] == pytest.approx(
            [e[1] for e in expected], rel=1e-4
        )
