"""SQuAD v1.1 and v2.0 metrics with the semantics of the official evaluation scripts.

``evaluate.load("squad")`` / ``evaluate.load("squad_v2")`` fetch their scripts from the Hugging
Face Hub, which the training machines cannot reach. This module re-implements the two official
scripts (the SQuAD v1.1 ``evaluate-v1.1.py`` and the SQuAD v2.0 ``evaluate-v2.0.py``) in plain
Python so that scores are comparable with published numbers, including their small quirks:

* v1.1 F1 is 0 whenever prediction and gold share no token, so an empty prediction against an
  empty gold scores 0.
* v2.0 F1 is ``gold_tokens == prediction_tokens`` (0 or 1) when either side has no token, so an
  empty prediction against an empty gold (an unanswerable question) scores 1.
* v2.0 drops gold answers that normalise to the empty string and uses ``[""]`` when none is
  left, and reports ``best_exact`` / ``best_f1`` over the no-answer probability thresholds.

Predictions and references are plain mappings keyed by question id; see
:func:`references_from_squad_json` to read the gold answers of an official SQuAD JSON file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "exact_match_score",
    "f1_score",
    "f1_score_v2",
    "normalize_answer",
    "references_from_squad_json",
    "squad_v1",
    "squad_v2",
]

# Both official scripts use exactly this pattern (v2.0 adds re.UNICODE, which is already the
# default for str patterns in Python 3, so one compiled pattern serves both versions).
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b", re.UNICODE)
# Only ASCII punctuation is removed, as in the official scripts: Unicode quotes and dashes stay.
# str.translate deletes exactly the characters the official per-character filter drops, but runs
# in C (scoring a full dev set normalises tens of thousands of strings).
_DELETE_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """Normalises an answer the way the official SQuAD scripts do.

    The steps run in the official order: lower-case, drop ASCII punctuation, replace the
    articles ``a``/``an``/``the`` by a space, then collapse runs of whitespace. The order
    matters: punctuation goes before articles, so ``"the-end"`` becomes ``"theend"`` and keeps
    its article.

    Args:
        s: Raw answer text.

    Returns:
        The normalised text (possibly empty).
    """
    text = s.lower().translate(_DELETE_PUNCTUATION)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """Exact match of the normalised texts (identical in SQuAD v1.1 and v2.0).

    Args:
        prediction: Predicted answer text.
        ground_truth: One gold answer text.

    Returns:
        1.0 when the normalised texts are equal, else 0.0.
    """
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def _token_f1(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 for two non-empty token lists that may share no token.

    The arithmetic follows the official scripts step by step so results are bit-identical.
    """
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-level F1 with SQuAD v1.1 semantics.

    Tokens are ``normalize_answer(text).split()``. As in the official v1.1 script, F1 is 0 when
    the two sides share no token, which includes the case where both are empty.

    Args:
        prediction: Predicted answer text.
        ground_truth: One gold answer text.

    Returns:
        F1 in [0, 1].
    """
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _v2_tokens(s: str) -> list[str]:
    """Tokenises like ``get_tokens`` of the official v2.0 script."""
    if not s:
        return []
    return normalize_answer(s).split()


def f1_score_v2(prediction: str, ground_truth: str) -> float:
    """Token-level F1 with SQuAD v2.0 semantics (``compute_f1`` of the official v2.0 script).

    Unlike :func:`f1_score`, when either side has no token the score is 1.0 if both have none
    and 0.0 otherwise, so predicting "no answer" for an unanswerable question scores 1.

    Args:
        prediction: Predicted answer text ("" means no answer).
        ground_truth: One gold answer text ("" for an unanswerable question).

    Returns:
        F1 in [0, 1].
    """
    gold_toks = _v2_tokens(ground_truth)
    pred_toks = _v2_tokens(prediction)
    if not gold_toks or not pred_toks:
        return float(gold_toks == pred_toks)
    return _token_f1(pred_toks, gold_toks)


def _check_gold(qid: str, golds: Sequence[str]) -> None:
    # A bare string is a Sequence[str] too; max() over its characters would silently give
    # nonsense scores, so refuse it loudly.
    if isinstance(golds, str):
        raise TypeError(
            f"references[{qid!r}] must be a sequence of answer strings, not a str: {golds!r}"
        )


def _max_over_ground_truths(
    metric: Callable[[str, str], float], prediction: str, ground_truths: Sequence[str]
) -> float:
    return max(metric(prediction, gt) for gt in ground_truths)


def squad_v1(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]
) -> dict[str, float]:
    """Scores predictions with the official SQuAD v1.1 semantics.

    Each question scores the maximum over its gold answers. Questions without a prediction score
    0 and still count in the total, as in the official script (which prints one line per
    missing id; here one warning gives the count). Predictions for ids absent from the
    references are ignored.

    Args:
        predictions: Question id -> predicted answer text.
        references: Question id -> gold answer texts (at least one per question).

    Returns:
        ``{"exact_match": pct, "f1": pct, "total": n}`` with percentages in [0, 100].

    Raises:
        ValueError: If ``references`` is empty or a question has no gold answer (v1.1 has no
            unanswerable questions; use :func:`squad_v2`).
        TypeError: If a reference value is a single string instead of a sequence.
    """
    if not references:
        raise ValueError("squad_v1 needs at least one reference")
    exact_match = 0.0
    f1 = 0.0
    total = 0
    missing = 0
    for qid, ground_truths in references.items():
        _check_gold(qid, ground_truths)
        if len(ground_truths) == 0:
            raise ValueError(
                f"question {qid!r} has no gold answer; SQuAD v1.1 has no unanswerable "
                "questions (use squad_v2)"
            )
        total += 1
        if qid not in predictions:
            missing += 1
            continue
        prediction = predictions[qid]
        exact_match += _max_over_ground_truths(exact_match_score, prediction, ground_truths)
        f1 += _max_over_ground_truths(f1_score, prediction, ground_truths)
    if missing:
        logger.warning("%d of %d questions have no prediction and score 0", missing, total)
    return {
        "exact_match": 100.0 * exact_match / total,
        "f1": 100.0 * f1 / total,
        "total": total,
    }


def _apply_no_answer_threshold(
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    qid_to_has_ans: Mapping[str, bool],
    threshold: float,
) -> dict[str, float]:
    # A question whose no-answer probability exceeds the threshold counts as answered with
    # "no answer": right (1) exactly when it is unanswerable, whatever the text prediction was.
    return {
        qid: float(not qid_to_has_ans[qid]) if na_probs[qid] > threshold else score
        for qid, score in scores.items()
    }


def _find_best_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    qid_to_has_ans: Mapping[str, bool],
) -> tuple[float, float]:
    """Best score over no-answer thresholds, as ``find_best_thresh`` of the official script.

    Starting from "every question predicted unanswerable", questions are switched to their text
    prediction in order of increasing no-answer probability; the best running score and the
    probability where it was reached are returned. ``sorted`` is stable, so ties keep the order
    of ``na_probs`` exactly as in the official script (it matters for the running maximum).
    """
    num_no_ans = sum(1 for has_ans in qid_to_has_ans.values() if not has_ans)
    cur_score = float(num_no_ans)
    best_score = cur_score
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            cur_score += scores[qid]
        elif predictions[qid]:
            # Answering an unanswerable question costs a point. The official script tests the
            # raw prediction text, not its normalised form, so "the" counts as an answer here.
            cur_score -= 1.0
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = float(na_probs[qid])
    return 100.0 * best_score / len(scores), best_thresh


def squad_v2(
    predictions: Mapping[str, str],
    references: Mapping[str, Sequence[str]],
    no_answer_probs: Mapping[str, float] | None = None,
    no_answer_threshold: float = 1.0,
) -> dict[str, float]:
    """Scores predictions with the official SQuAD v2.0 semantics.

    Follows ``evaluate-v2.0.py``: raw per-question scores (max over gold answers, v2.0
    tokenisation), the no-answer threshold, the HasAns/NoAns split and the best thresholds.
    Gold answers that normalise to "" are dropped and an empty list becomes ``[""]``. A question
    is answerable when its reference list is non-empty (the official ``bool(qa["answers"])``).

    Args:
        predictions: Question id -> predicted answer text ("" means no answer). Predictions for
            ids absent from the references are ignored.
        references: Question id -> gold answer texts; an empty list marks an unanswerable
            question.
        no_answer_probs: Question id -> probability that the question has no answer. When
            None, every probability is 0.0, as the official script does without a na-prob file.
        no_answer_threshold: A question whose no-answer probability is strictly above this
            counts as predicted unanswerable (official default 1.0).

    Returns:
        ``exact_match``, ``f1``, ``total``, ``HasAns_exact``, ``HasAns_f1``, ``HasAns_total``,
        ``NoAns_exact``, ``NoAns_f1``, ``NoAns_total``, ``best_exact``, ``best_exact_thresh``,
        ``best_f1``, ``best_f1_thresh``. Scores are percentages; the HasAns_*/NoAns_* keys are
        left out when that subset is empty, as the official script does. ``exact_match`` is the
        official script's ``exact``.

    Raises:
        ValueError: If ``references`` is empty, or a question has no prediction or no no-answer
            probability (the official script cannot score those either: it stops with a
            KeyError).
        TypeError: If a reference value is a single string instead of a sequence.
    """
    na_probs = _no_answer_probs(predictions, references, no_answer_probs)
    qid_to_has_ans, exact_raw, f1_raw = _raw_scores(predictions, references)
    exact_thresh = _apply_no_answer_threshold(
        exact_raw, na_probs, qid_to_has_ans, no_answer_threshold
    )
    f1_thresh = _apply_no_answer_threshold(f1_raw, na_probs, qid_to_has_ans, no_answer_threshold)
    overall = _mean_scores("", exact_thresh, f1_thresh, list(qid_to_has_ans))
    result = {"exact_match": overall.pop("exact"), **overall}
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        qids = [qid for qid, has_ans in qid_to_has_ans.items() if has_ans == wanted]
        if qids:
            result.update(_mean_scores(f"{prefix}_", exact_thresh, f1_thresh, qids))
    # The official best-threshold search works on the raw scores, before any threshold.
    for name, raw in (("exact", exact_raw), ("f1", f1_raw)):
        best, thresh = _find_best_threshold(predictions, raw, na_probs, qid_to_has_ans)
        result[f"best_{name}"], result[f"best_{name}_thresh"] = best, thresh
    return result


def _no_answer_probs(
    predictions: Mapping[str, str],
    references: Mapping[str, Sequence[str]],
    no_answer_probs: Mapping[str, float] | None,
) -> Mapping[str, float]:
    """The no-answer probabilities, after checking every question has a prediction and one."""
    if not references:
        raise ValueError("squad_v2 needs at least one reference")
    missing = [qid for qid in references if qid not in predictions]
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(references)} questions have no prediction "
            f"(first: {missing[:5]}); SQuAD v2.0 scores need one per question"
        )
    if no_answer_probs is None:
        # Official script without --na-prob-file: {k: 0.0 for k in preds}, in prediction order
        # (the order decides ties in the best-threshold search).
        return dict.fromkeys(predictions, 0.0)
    missing = [qid for qid in references if qid not in no_answer_probs]
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(references)} questions have no no-answer probability "
            f"(first: {missing[:5]})"
        )
    return no_answer_probs


def _raw_scores(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]
) -> tuple[dict[str, bool], dict[str, float], dict[str, float]]:
    """Per question: answerable or not, and exact match and F1 against its best gold answer."""
    qid_to_has_ans: dict[str, bool] = {}
    exact_raw: dict[str, float] = {}
    f1_raw: dict[str, float] = {}
    for qid, answers in references.items():
        _check_gold(qid, answers)
        qid_to_has_ans[qid] = len(answers) > 0
        gold_answers = [a for a in answers if normalize_answer(a)] or [""]
        prediction = predictions[qid]
        exact_raw[qid] = _max_over_ground_truths(exact_match_score, prediction, gold_answers)
        f1_raw[qid] = _max_over_ground_truths(f1_score_v2, prediction, gold_answers)
    return qid_to_has_ans, exact_raw, f1_raw


def _mean_scores(
    prefix: str, exact: Mapping[str, float], f1: Mapping[str, float], qids: list[str]
) -> dict[str, float]:
    return {
        f"{prefix}exact": 100.0 * sum(exact[k] for k in qids) / len(qids),
        f"{prefix}f1": 100.0 * sum(f1[k] for k in qids) / len(qids),
        f"{prefix}total": len(qids),
    }


def references_from_squad_json(path: str | os.PathLike) -> tuple[dict[str, list[str]], bool]:
    """Reads the gold answers of an official (nested) SQuAD JSON file.

    Args:
        path: A file shaped like ``{"data": [{"title", "paragraphs": [{"context", "qas":
            [{"id", "question", "answers": [{"text", "answer_start"}], "is_impossible"?}]}]}],
            "version"}``.

    Returns:
        ``(references, is_v2)``: question id -> gold answer texts in file order (duplicates kept,
        as the official scripts see them; unanswerable questions map to ``[]``), and whether the
        file is SQuAD v2.0-style, i.e. any question carries an ``is_impossible`` field.
    """
    with open(path, encoding="utf-8") as f:
        dataset = json.load(f)
    references: dict[str, list[str]] = {}
    is_v2 = False
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if "is_impossible" in qa:
                    is_v2 = True
                # v2.0 files already give unanswerable questions "answers": [] (the candidate
                # spans live in "plausible_answers"); the flag is checked too in case a file
                # carries answers anyway.
                if qa.get("is_impossible", False):
                    references[qa["id"]] = []
                else:
                    references[qa["id"]] = [a["text"] for a in qa["answers"]]
    return references, is_v2
