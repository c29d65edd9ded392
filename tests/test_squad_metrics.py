"""Tests of the offline SQuAD v1.1 / v2.0 metrics against hand-computed values and real data."""

import os

# The machines are offline; make any accidental Hub access fail fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")

import json
import logging
from pathlib import Path

import pytest

from recipes.metrics import squad
from recipes.metrics.squad import (
    exact_match_score,
    f1_score,
    f1_score_v2,
    normalize_answer,
    references_from_squad_json,
    squad_v1,
    squad_v2,
)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SQUAD_DIR = SHARED_DATA / "squad"
EVALUATE_SCRIPT = Path(squad.__file__).with_name("squad_evaluate.py")


def _shared_file(name: str) -> Path:
    path = SQUAD_DIR / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared/data is only on development machines)")
    return path


# --------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Quick, Brown Fox!", "quick brown fox"),
        ("  An apple\ta day\n", "apple day"),
        ("A.B.C.", "abc"),
        # Articles are only whole words.
        ("Theater anthem", "theater anthem"),
        # Punctuation goes before articles, so a hyphenated article survives glued to its word.
        ("the-end", "theend"),
        ("Levi's Stadium", "levis stadium"),
        # Only ASCII punctuation is removed, as in the official scripts.
        ("“Beyoncé”", "“beyoncé”"),
        ("the a an", ""),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_exact_match_score() -> None:
    assert exact_match_score("The Eiffel Tower.", "eiffel tower") == 1.0
    assert exact_match_score("Eiffel", "eiffel tower") == 0.0
    assert exact_match_score("", "") == 1.0
    assert exact_match_score("the", "") == 1.0
    assert isinstance(exact_match_score("a", "b"), float)


def test_f1_partial_overlap() -> None:
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: P = 3/4, R = 1, F1 = 6/7.
    assert f1_score("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)
    # Counts are clipped: pred [new, york, new, york] vs gold [new, york]: P = 1/2, R = 1.
    assert f1_score("New York, New York", "new york") == pytest.approx(2 / 3)
    # pred [broncos] vs gold [denver, broncos]: P = 1, R = 1/2.
    assert f1_score("Broncos", "The Denver Broncos") == pytest.approx(2 / 3)
    assert f1_score("Denver Broncos!", "the denver broncos") == 1.0
    assert f1_score("Carolina", "Denver Broncos") == 0.0
    # v2.0 agrees whenever both sides have tokens.
    assert f1_score_v2("the cat sat on the mat", "a cat on a mat") == f1_score(
        "the cat sat on the mat", "a cat on a mat"
    )


def test_f1_empty_strings_v1_vs_v2() -> None:
    # v1.1: no common token means 0, even when both sides are empty.
    assert f1_score("", "") == 0.0
    assert f1_score("the", "") == 0.0
    assert f1_score("", "cat") == 0.0
    # v2.0: if either side is empty, F1 is whether both are.
    assert f1_score_v2("", "") == 1.0
    assert f1_score_v2("the", "") == 1.0
    assert f1_score_v2("", "a an the") == 1.0
    assert f1_score_v2("", "cat") == 0.0
    assert f1_score_v2("cat", "") == 0.0


# --------------------------------------------------------------------------- squad_v1


def test_squad_v1_hand_computed_and_missing(caplog: pytest.LogCaptureFixture) -> None:
    references = {
        "q1": ["Denver Broncos", "The Denver Broncos"],
        "q2": ["Santa Clara, California"],
        "q3": ["gold"],
    }
    predictions = {"q1": "Broncos", "q2": "Santa Clara", "unknown-id": "ignored"}
    with caplog.at_level(logging.WARNING, logger="recipes.metrics.squad"):
        result = squad_v1(predictions, references)
    # q1: F1 2/3 (max over golds), q2: P = 1, R = 2/3 -> F1 0.8, q3 missing -> 0.
    assert result == {
        "exact_match": 0.0,
        "f1": pytest.approx(100 * (2 / 3 + 0.8) / 3),
        "total": 3,
    }
    warnings = [r for r in caplog.records if r.name == "recipes.metrics.squad"]
    assert len(warnings) == 1
    assert "1 of 3" in warnings[0].getMessage()


def test_squad_v1_empty_gold_after_normalisation() -> None:
    # v1.1 quirk: "" vs gold "the" is an exact match but has F1 0.
    assert squad_v1({"q": ""}, {"q": ["the"]}) == {"exact_match": 100.0, "f1": 0.0, "total": 1}


def test_squad_v1_rejects_bad_references() -> None:
    with pytest.raises(ValueError, match="at least one"):
        squad_v1({}, {})
    with pytest.raises(ValueError, match="no gold answer"):
        squad_v1({"q": ""}, {"q": []})
    with pytest.raises(TypeError, match="not a str"):
        squad_v1({"q": "x"}, {"q": "x"})  # type: ignore[dict-item]


# --------------------------------------------------------------------------- squad_v2

V2_REFERENCES = {
    "a": ["Normandy"],
    "b": [],
    "c": ["10th and 11th centuries", "in the 10th and 11th centuries"],
    "d": [],
}
V2_PREDICTIONS = {"a": "Normandy", "b": "France", "c": "11th centuries", "d": ""}
# Raw (exact, f1): a (1, 1); b (0, 0); c (0, 2/3: pred [11th, centuries] vs the first gold's
# 4 tokens, P = 1, R = 1/2); d (1, 1).


def test_squad_v2_without_probabilities() -> None:
    result = squad_v2(V2_PREDICTIONS, V2_REFERENCES)
    assert result == pytest.approx(
        {
            "exact_match": 50.0,
            "f1": 100 * (1 + 0 + 2 / 3 + 1) / 4,
            "total": 4,
            "HasAns_exact": 50.0,
            "HasAns_f1": 100 * (1 + 2 / 3) / 2,
            "HasAns_total": 2,
            "NoAns_exact": 50.0,
            "NoAns_f1": 50.0,
            "NoAns_total": 2,
            # All probabilities are 0.0, so the search walks the questions in prediction order
            # (a, b, c, d) from 2 (the unanswerable count): +1 after a is the best running score
            # (official quirk: reported with threshold 0.0).
            "best_exact": 75.0,
            "best_exact_thresh": 0.0,
            "best_f1": 75.0,
            "best_f1_thresh": 0.0,
        }
    )


def test_squad_v2_with_probabilities_and_threshold() -> None:
    probs = {"a": 0.1, "b": 0.9, "c": 0.4, "d": 0.6}
    result = squad_v2(V2_PREDICTIONS, V2_REFERENCES, probs, no_answer_threshold=0.5)
    # b and d are above 0.5: predicted unanswerable, which is right for both -> (1, 1).
    assert result == pytest.approx(
        {
            "exact_match": 75.0,
            "f1": 100 * (1 + 1 + 2 / 3 + 1) / 4,
            "total": 4,
            "HasAns_exact": 50.0,
            "HasAns_f1": 100 * (1 + 2 / 3) / 2,
            "HasAns_total": 2,
            "NoAns_exact": 100.0,
            "NoAns_f1": 100.0,
            "NoAns_total": 2,
            # Sorted by probability a, c, d, b from 2: exact 3, 3, 3, 2 -> best 3 after a (0.1);
            # f1 3, 3 + 2/3, 3 + 2/3, 2 + 2/3 -> best after c (0.4).
            "best_exact": 75.0,
            "best_exact_thresh": 0.1,
            "best_f1": 100 * (3 + 2 / 3) / 4,
            "best_f1_thresh": 0.4,
        }
    )
    # A probability equal to the threshold does not switch to "no answer" (strict >).
    at_threshold = squad_v2(V2_PREDICTIONS, V2_REFERENCES, dict.fromkeys(V2_PREDICTIONS, 1.0))
    assert at_threshold["exact_match"] == 50.0


def test_squad_v2_subsets_and_empty_golds() -> None:
    only_answerable = squad_v2({"a": "Normandy"}, {"a": ["Normandy"]})
    assert "NoAns_total" not in only_answerable
    assert only_answerable["HasAns_total"] == 1
    only_unanswerable = squad_v2({"b": ""}, {"b": []})
    assert "HasAns_total" not in only_unanswerable
    assert only_unanswerable["NoAns_exact"] == 100.0
    # Golds that normalise to "" are dropped and replaced by [""], but the question still counts
    # as answerable (it has answers in the file).
    result = squad_v2({"q": ""}, {"q": ["The", "a"]})
    assert result["HasAns_exact"] == 100.0
    assert result["HasAns_f1"] == 100.0


def test_squad_v2_rejects_missing_inputs() -> None:
    with pytest.raises(ValueError, match="no prediction"):
        squad_v2({"a": "x"}, {"a": ["x"], "b": []})
    with pytest.raises(ValueError, match="no-answer probability"):
        squad_v2({"a": "x", "b": ""}, {"a": ["x"], "b": []}, {"a": 0.5})
    with pytest.raises(ValueError, match="at least one"):
        squad_v2({}, {})


# --------------------------------------------------------------------------- JSON references


def test_references_from_squad_json(tmp_path: Path) -> None:
    def qa(qid: str, answers: list[str], **extra: object) -> dict:
        return {
            "id": qid,
            "question": "?",
            "answers": [{"text": t, "answer_start": 0} for t in answers],
            **extra,
        }

    def write(name: str, qas: list[dict], version: str) -> Path:
        data = {"data": [{"title": "T", "paragraphs": [{"context": "c", "qas": qas}]}]}
        path = tmp_path / name
        path.write_text(json.dumps({**data, "version": version}), encoding="utf-8")
        return path

    v1 = write("v1.json", [qa("x", ["A", "A", "B"]), qa("y", ["C"])], "1.1")
    assert references_from_squad_json(v1) == ({"x": ["A", "A", "B"], "y": ["C"]}, False)
    v2 = write(
        "v2.json",
        [
            qa("x", ["A"], is_impossible=False),
            qa("y", [], is_impossible=True, plausible_answers=[{"text": "P", "answer_start": 0}]),
        ],
        "v2.0",
    )
    assert references_from_squad_json(str(v2)) == ({"x": ["A"], "y": []}, True)


# --------------------------------------------------------------------------- real data


@pytest.mark.shared_data
def test_v1_perfect_predictions_on_dev_part1() -> None:
    references, is_v2 = references_from_squad_json(_shared_file("dev-v1.1-part1.json"))
    assert not is_v2
    predictions = {qid: golds[0] for qid, golds in references.items()}
    assert squad_v1(predictions, references) == {"exact_match": 100.0, "f1": 100.0, "total": 4961}


@pytest.mark.shared_data
def test_v1_known_values_on_dev_part1(caplog: pytest.LogCaptureFixture) -> None:
    references, _ = references_from_squad_json(_shared_file("dev-v1.1-part1.json"))
    predictions = {
        # golds "Denver Broncos" x3: pred [denver, broncos, team], P = 2/3, R = 1 -> F1 0.8.
        "56be4db0acb8001400a502ec": "the Denver Broncos team",
        # third gold is "Levi's Stadium": exact match.
        "56be4db0acb8001400a502ee": "Levi's Stadium",
        # golds '"golden anniversary"', 'gold-themed' (-> "goldthemed"): no common token.
        "56be8e613aeaaa14008c90d1": "gold",
        # gold "gold": exact after normalisation.
        "56be4db0acb8001400a502f0": "Gold.",
    }
    subset = {qid: references[qid] for qid in predictions}
    assert squad_v1(predictions, subset) == {
        "exact_match": 50.0,
        "f1": pytest.approx(100 * (0.8 + 1 + 0 + 1) / 4),
        "total": 4,
    }
    # Against the whole file the other 4957 questions are missing and score 0.
    with caplog.at_level(logging.WARNING, logger="recipes.metrics.squad"):
        full = squad_v1(predictions, references)
    assert full["exact_match"] == pytest.approx(100 * 2 / 4961)
    assert full["f1"] == pytest.approx(100 * 2.8 / 4961)
    assert "4957 of 4961" in caplog.text


@pytest.mark.shared_data
def test_v2_empty_predictions_on_dev_sample() -> None:
    references, is_v2 = references_from_squad_json(_shared_file("dev-v2.0-sample.json"))
    assert is_v2
    assert sum(1 for golds in references.values() if not golds) == 702
    result = squad_v2(dict.fromkeys(references, ""), references)
    assert round(result["exact_match"], 2) == 49.89
    assert result["exact_match"] == pytest.approx(100 * 702 / 1407)
    assert result["f1"] == pytest.approx(100 * 702 / 1407)
    assert result["total"] == 1407
    assert result["NoAns_exact"] == 100.0
    assert result["NoAns_total"] == 702
    assert result["HasAns_exact"] == 0.0
    assert result["HasAns_total"] == 705


@pytest.mark.shared_data
def test_v2_perfect_predictions_on_dev_sample() -> None:
    references, _ = references_from_squad_json(_shared_file("dev-v2.0-sample.json"))
    predictions = {qid: golds[0] if golds else "" for qid, golds in references.items()}
    result = squad_v2(predictions, references)
    assert result["exact_match"] == 100.0
    assert result["f1"] == 100.0
    assert result["best_exact"] == 100.0
    assert result["best_f1"] == 100.0


@pytest.mark.shared_data
def test_v2_known_values_on_dev_sample() -> None:
    references, _ = references_from_squad_json(_shared_file("dev-v2.0-sample.json"))
    predictions = {
        # golds "10th and 11th centuries" (4 tokens), "in the 10th and 11th centuries" (5):
        # pred [11th, century] shares "11th" only -> max(F1) = 2 * 1/2 * 1/4 / (3/4) = 1/3.
        "56ddde6b9a695914005b9629": "the 11th century",
        # gold "the first half of the 10th century" -> [first, half, of, 10th, century]:
        # P = 1, R = 2/5 -> F1 4/7.
        "56ddde6b9a695914005b962c": "first half",
        # Unanswerable: "" is right (1, 1), "Rollo" is wrong (0, 0).
        "5ad39d53604f3c001a3fe8d1": "",
        "5ad39d53604f3c001a3fe8d2": "Rollo",
    }
    subset = {qid: references[qid] for qid in predictions}
    assert [bool(subset[qid]) for qid in predictions] == [True, True, False, False]
    result = squad_v2(predictions, subset)
    assert result == pytest.approx(
        {
            "exact_match": 25.0,
            "f1": 100 * (1 / 3 + 4 / 7 + 1 + 0) / 4,
            "total": 4,
            "HasAns_exact": 0.0,
            "HasAns_f1": 100 * (1 / 3 + 4 / 7) / 2,
            "HasAns_total": 2,
            "NoAns_exact": 50.0,
            "NoAns_f1": 50.0,
            "NoAns_total": 2,
            # From 2: exact stays 2 until "Rollo" (-1); f1 peaks at 2 + 1/3 + 4/7.
            "best_exact": 50.0,
            "best_exact_thresh": 0.0,
            "best_f1": 100 * (2 + 1 / 3 + 4 / 7) / 4,
            "best_f1_thresh": 0.0,
        }
    )


# --------------------------------------------------------------------------- evaluate module


@pytest.fixture(scope="module")
def load_metric():
    evaluate = pytest.importorskip("evaluate")

    def load(config_name: str):
        return evaluate.load(str(EVALUATE_SCRIPT), config_name)

    return load


def _hub_references(references: dict[str, list[str]]) -> list[dict]:
    return [
        {"id": qid, "answers": {"text": golds, "answer_start": [0] * len(golds)}}
        for qid, golds in references.items()
    ]


# `import evaluate` pulls in transformers and torch (seconds on a busy machine), hence "slow".
@pytest.mark.slow
def test_evaluate_module_squad_v1(load_metric) -> None:
    metric = load_metric("squad")
    references = {"q1": ["Denver Broncos", "The Denver Broncos"], "q2": ["Santa Clara"]}
    predictions = {"q1": "Broncos", "q2": "santa clara"}
    result = metric.compute(
        predictions=[{"id": k, "prediction_text": v} for k, v in predictions.items()],
        references=_hub_references(references),
    )
    assert result == squad_v1(predictions, references)
    assert result["exact_match"] == 50.0


@pytest.mark.slow
def test_evaluate_module_squad_v2(load_metric) -> None:
    metric = load_metric("squad_v2")
    hub_references = _hub_references(V2_REFERENCES)
    result = metric.compute(
        predictions=[{"id": k, "prediction_text": v} for k, v in V2_PREDICTIONS.items()],
        references=hub_references,
    )
    expected = squad_v2(V2_PREDICTIONS, V2_REFERENCES)
    assert result == {"exact": expected["exact_match"], **expected}

    probs = {"a": 0.1, "b": 0.9, "c": 0.4, "d": 0.6}
    result = metric.compute(
        predictions=[
            {"id": k, "prediction_text": v, "no_answer_probability": probs[k]}
            for k, v in V2_PREDICTIONS.items()
        ],
        references=hub_references,
        no_answer_threshold=0.5,
    )
    expected = squad_v2(V2_PREDICTIONS, V2_REFERENCES, probs, no_answer_threshold=0.5)
    assert result == {"exact": expected["exact_match"], **expected}
    assert result["best_f1_thresh"] == 0.4

    with pytest.raises(ValueError, match="every prediction or for none"):
        metric.compute(
            predictions=[
                {"id": "a", "prediction_text": "x", "no_answer_probability": 0.5},
                {"id": "b", "prediction_text": ""},
            ],
            references=hub_references[:2],
        )
