"""``mode=eval``: a trained model scored on the eval split without training, from its final/ or
from a run's checkpoint, on one process or two, gives the training run's last evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_torchrun, run_train

pytestmark = pytest.mark.slow

SMOKE = ("recipe=bert_squad_v2", "debug=smoke", "logger=none", "trainer.progress_bar=false")
SCORES = ("eval/exact_match", "eval/f1", "eval/HasAns_f1", "eval/NoAns_f1")


def _scores(run: Path) -> dict[str, float]:
    metrics = json.loads((run / "results.json").read_text())["metrics"]
    return {k: metrics[k] for k in SCORES}


def test_eval_mode_gives_the_training_runs_last_scores(tmp_path, cache_dir):
    run = tmp_path / "run"
    cache = f"data.cache_dir={cache_dir}"
    run_train(
        *SMOKE,
        cache,
        f"output_dir={run}",
        "trainer.max_steps=10",
        "trainer.save_every_n_steps=10",
        "trainer.eval_at_start=false",
    )
    trained = _scores(run)
    assert trained["eval/f1"] > 0
    for name, source in (
        ("final", f"model.name_or_path={run}/final"),
        ("checkpoint", f"resume={run}"),
    ):
        scored = tmp_path / name
        done = run_train(*SMOKE, cache, "mode=eval", source, f"output_dir={scored}")
        assert _scores(scored) == trained, name
        assert (scored / "predictions.json").read_text() == (run / "predictions.json").read_text()
        assert not (scored / "final").exists() and not (scored / "checkpoints").exists()
        assert "train/loss" not in (scored / "metrics.jsonl").read_text()
        assert "evaluated" in done.stderr
    two = tmp_path / "two"
    proc = run_torchrun(
        *SMOKE, cache, "mode=eval", f"model.name_or_path={run}/final", f"output_dir={two}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _scores(two) == pytest.approx(trained, abs=1e-9)
