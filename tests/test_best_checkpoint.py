"""Which step's weights ``final/`` holds: the best checkpoint's with
``trainer.load_best_model_at_end=true`` (by the task's main metric, ties to ``task.tie_metric``,
then to the latest evaluation), the last step's with false; contradictory settings refused in
one line. Real tiny runs (recipe=bert_swag debug=smoke, eight steps), their tensors compared with
the checkpoints'."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_train
from safetensors.torch import load_file

from recipes.validation import rank_against_best

QUIET = ("logger=none", "trainer.progress_bar=false")
# Eight steps, an evaluation of 40 dev rows every two: four candidates for the best.
SWAG = (
    "recipe=bert_swag",
    "debug=smoke",
    *QUIET,
    "trainer.max_steps=8",
    "trainer.eval_every_n_steps=2",
    "trainer.eval_at_start=false",
    "data.max_eval_examples=40",
)


def _evals(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/accuracy" in r]


def _best_step(evals: list[dict]) -> int:
    """The rule, written out: the highest accuracy, then the lowest loss, then the latest."""
    return max(evals, key=lambda r: (r["eval/accuracy"], -r["eval/loss"], r["step"]))["step"]


def _same_weights(a: Path, b: Path) -> bool:
    ours, theirs = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ours.keys() == theirs.keys()
    return all(ours[k].equal(theirs[k]) for k in ours)


@pytest.mark.slow
def test_final_holds_the_best_checkpoint_or_the_last_step(tmp_path, cache_dir):
    best_run, last_run = tmp_path / "best", tmp_path / "last"
    common = (*SWAG, f"data.cache_dir={cache_dir}")
    # The shipped SWAG smoke config asks for the best; every step saved, to compare with.
    done = run_train(*common, f"output_dir={best_run}", "trainer.keep_last_n_checkpoints=null",
                     "trainer.save_every_n_steps=2")  # fmt: skip
    evals = _evals(best_run)
    best = _best_step(evals)
    results = json.loads((best_run / "results.json").read_text())
    assert results["final_step"] == best == results["best"]["step"]
    recipe = json.loads((best_run / "final" / "recipe.json").read_text())
    assert recipe["step"] == best and recipe["steps"] == 8 and recipe["load_best_model_at_end"]
    checkpoints = best_run / "checkpoints"
    assert _same_weights(best_run / "final", checkpoints / f"step-{best:08d}")
    others = [r["step"] for r in evals if r["step"] != best]
    assert not any(_same_weights(best_run / "final", checkpoints / f"step-{s:08d}") for s in others)
    # The scores reported are the best evaluation's, and the done line names the step.
    chosen = next(r for r in evals if r["step"] == best)
    assert results["metrics"]["eval/accuracy"] == chosen["eval/accuracy"]
    assert f"final/ holds step {best}" in done.stderr

    run_train(*common, f"output_dir={last_run}", "trainer.load_best_model_at_end=false",
              "trainer.save_every_n_steps=8")  # fmt: skip
    results = json.loads((last_run / "results.json").read_text())
    assert results["final_step"] == 8
    assert results["metrics"]["eval/accuracy"] == _evals(last_run)[-1]["eval/accuracy"]
    assert _same_weights(last_run / "final", last_run / "checkpoints" / "step-00000008")


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (("trainer.eval_every_n_steps=0",), "trainer.eval_every_n_steps"),
        (("trainer.save_every_n_steps=0",), "trainer.save_every_n_steps"),
    ],
)
def test_best_model_without_evaluations_or_checkpoints_is_refused(tmp_path, overrides, words):
    run = tmp_path / "run"
    proc = run_train(*SWAG, f"output_dir={run}", "trainer.load_best_model_at_end=true",
                     *overrides, check=False)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: trainer.load_best_model_at_end=true")
    assert words in lines[-1] and "Traceback" not in proc.stderr


def test_ties_fall_to_the_second_metric_then_to_the_latest():
    bleu = SimpleNamespace(greater_is_better=True, tie_greater_is_better=True)
    best = {"value": 0.0, "tie_value": 6.9, "step": 100}
    assert rank_against_best(0.0, 2.5, best, bleu) == -1  # BLEU tied, chrF worse
    assert rank_against_best(0.0, 7.0, best, bleu) == 1  # BLEU tied, chrF better
    assert rank_against_best(0.0, 6.9, best, bleu) == 0  # both tied: the latest wins
    assert rank_against_best(0.1, 0.0, best, bleu) == 1  # the main metric first
    assert rank_against_best(0.0, None, best, bleu) == 0  # nothing to decide by
    accuracy = SimpleNamespace(greater_is_better=True, tie_greater_is_better=False)  # loss
    assert rank_against_best(0.3, 1.2, {"value": 0.3, "tie_value": 1.3}, accuracy) == 1
