"""``mode=eval``: a trained model scored on the eval split without training, from its final/ or
from a run's checkpoint, on one process or two, gives the training run's last evaluation; and
``mode=predict`` and ``python -m recipes.answer`` on the same questions without their answers
give the same answers. A task scored against its reference model (DPO, KTO) refuses a final/,
which would be its own reference, and scores a checkpoint against the model its run started
from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_torchrun, run_train, squad_questions

pytestmark = pytest.mark.slow

SMOKE = ("recipe=bert_squad_v2", "debug=smoke", "logger=none", "trainer.progress_bar=false")
DEV = ROOT / "recipes" / "assets" / "squad" / "v2" / "dev.json"
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
    _check_answers(run, tmp_path)
    _check_predictions(run, tmp_path, cache)
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


def _answer(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.answer", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _check_answers(run: Path, tmp_path: Path) -> None:
    """``python -m recipes.answer`` on the run's final/ answers the dev file as the run's last
    evaluation did (the answers and the n-best candidates with their probabilities), and a
    question given on the command line gets the best non-null candidate when the threshold
    rules out the null answer."""
    out = tmp_path / "answers.json"
    proc = _answer(str(run / "final"), "--file", str(DEV), "--out", str(out), "--n-best", "20")
    assert json.loads(out.read_text()) == json.loads((run / "predictions.json").read_text())
    assert "LOAD REPORT" not in proc.stderr and "Some weights" not in proc.stderr
    nbest = json.loads((tmp_path / "nbest_answers.json").read_text())
    expected = json.loads((run / "nbest_predictions.json").read_text())
    assert nbest.keys() == expected.keys()
    for qid, candidates in expected.items():
        assert [c["text"] for c in nbest[qid]] == [c["text"] for c in candidates], qid
        got = [c["probability"] for c in nbest[qid]]
        assert got == pytest.approx([c["probability"] for c in candidates], abs=1e-6), qid
    paragraph = json.loads(DEV.read_text())["data"][0]["paragraphs"][0]
    question = paragraph["qas"][0]
    best = next(c["text"] for c in expected[question["id"]] if c["text"])
    one = _answer(
        str(run / "final"),
        "--question",
        question["question"],
        "--context",
        paragraph["context"],
        "--threshold",
        "1e9",
    )
    assert one.stdout.strip() == best and best in paragraph["context"]


def _check_predictions(run: Path, tmp_path: Path, cache: str) -> None:
    """``mode=predict`` on the dev questions without answers or ids (JSON lines) answers as the
    run's last evaluation did; on the SQuAD file itself, with the null answer ruled out by the
    threshold, each answer is the best-scoring non-null candidate of the run's n-best list."""
    questions = tmp_path / "questions.jsonl"
    rows = squad_questions(DEV, questions)
    predicted = tmp_path / "predicted"
    done = run_train(
        *SMOKE,
        cache,
        "mode=predict",
        f"model.name_or_path={run}/final",
        f"data.predict_file={questions}",
        f"output_dir={predicted}",
    )
    expected = json.loads((run / "predictions.json").read_text())
    answers = json.loads((predicted / "predictions.json").read_text())
    assert list(answers.values()) == list(expected.values())
    assert list(answers) == [str(i) for i in range(rows)]  # numbered, in file order
    assert json.loads((predicted / "results.json").read_text())["rows"] == rows
    assert "LOAD REPORT" not in done.stderr and "Some weights" not in done.stderr
    assert not (predicted / "checkpoints").exists() and not (predicted / "metrics.jsonl").exists()

    spans = tmp_path / "spans"
    run_train(
        *SMOKE,
        cache,
        "mode=predict",
        f"model.name_or_path={run}/final",
        f"data.predict_file={DEV}",
        "task.null_score_diff_threshold=1e9",
        f"output_dir={spans}",
    )
    answers = json.loads((spans / "predictions.json").read_text())
    nbest = json.loads((run / "nbest_predictions.json").read_text())
    assert answers.keys() == nbest.keys()
    for qid, candidates in nbest.items():
        spans_only = [c for c in candidates if c["text"]]
        top = max(c["start_logit"] + c["end_logit"] for c in spans_only)
        tied = {c["text"] for c in spans_only if c["start_logit"] + c["end_logit"] == top}
        assert answers[qid] in tied, qid


KTO = ("recipe=llama_kto", "debug=smoke", "logger=none", "trainer.progress_bar=false")
TINY_LLAMA = ROOT / "recipes" / "assets" / "tiny-llama"


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    return line


def test_eval_against_a_reference_refuses_a_final_and_scores_a_checkpoint(tmp_path, cache_dir):
    """KTO's final/ would be its own reference (every reward and the KL exactly 0, where the
    training run's last evaluation had real ones): refused in one line, nothing written; with
    resume=<run> the checkpoint gets the run's numbers. DPO is refused as KTO; ORPO, which has
    no reference, is scored."""
    run, cache = tmp_path / "run", f"data.cache_dir={cache_dir}"
    run_train(
        *KTO,
        cache,
        f"output_dir={run}",
        "trainer.max_steps=4",
        "trainer.save_every_n_steps=4",
        "trainer.eval_at_start=false",
    )
    trained = json.loads((run / "results.json").read_text())["metrics"]
    assert trained["eval/kl"] > 0 and trained["eval/rewards/margins"] != 0

    final = tmp_path / "final"
    refused = run_train(
        *KTO,
        cache,
        "mode=eval",
        f"model.name_or_path={run}/final",
        f"output_dir={final}",
        check=False,
    )
    line = _one_error(refused)
    assert "task=kto" in line and "resume=<run folder>" in line
    assert not (final / "results.json").exists() and not (final / "metrics.jsonl").exists()

    checkpoint = tmp_path / "checkpoint"
    run_train(*KTO, cache, "mode=eval", f"resume={run}", f"output_dir={checkpoint}")
    scored = json.loads((checkpoint / "results.json").read_text())["metrics"]
    # The same weights and rows: equal up to float32 rounding of the summed log-probs, which
    # differs across CPUs (a reward near 0.04 moved by 7e-8 on one with bf16 instructions).
    for key in ("eval/kl", "eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margins"):
        assert scored[key] == pytest.approx(trained[key], rel=1e-6, abs=1e-6), key

    dpo = ("recipe=llama_dpo", "debug=smoke", "logger=none", cache, "mode=eval")
    model = f"model.name_or_path={TINY_LLAMA}"
    line = _one_error(run_train(*dpo, model, f"output_dir={tmp_path / 'dpo'}", check=False))
    assert "task=dpo" in line
    orpo = tmp_path / "orpo"
    run_train(*dpo, model, "task.loss_type=orpo", f"output_dir={orpo}")
    assert "eval/loss" in json.loads((orpo / "results.json").read_text())["metrics"]
