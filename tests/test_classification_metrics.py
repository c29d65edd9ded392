"""GLUE metrics written in numpy agree with scikit-learn and scipy."""

from __future__ import annotations

import numpy as np
import pytest

from recipes.metrics.classification import classification_scores, regression_scores

sklearn_metrics = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("num_labels", [2, 3, 5])
def test_classification_scores_match_sklearn(num_labels):
    rng = np.random.default_rng(num_labels)
    labels = rng.integers(0, num_labels, 500)
    # Mostly right, sometimes wrong: a realistic confusion matrix.
    predictions = np.where(rng.random(500) < 0.7, labels, rng.integers(0, num_labels, 500))
    scores = classification_scores(predictions, labels, num_labels)
    average = "binary" if num_labels == 2 else "macro"
    assert scores["accuracy"] == pytest.approx(sklearn_metrics.accuracy_score(labels, predictions))
    assert scores["f1"] == pytest.approx(
        sklearn_metrics.f1_score(labels, predictions, average=average)
    )
    assert scores["matthews_correlation"] == pytest.approx(
        sklearn_metrics.matthews_corrcoef(labels, predictions)
    )


def test_degenerate_predictions_score_zero_not_nan():
    labels = np.array([0, 1, 1, 0])
    constant = np.zeros(4, dtype=np.int64)
    scores = classification_scores(constant, labels, 2)
    assert scores == {"accuracy": 0.5, "f1": 0.0, "matthews_correlation": 0.0}


def test_regression_scores_match_scipy_with_ties():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 6, 300).astype(np.float64)  # STS-B-like scores, many ties
    predictions = labels + rng.normal(0, 1.5, 300)
    predictions[:20] = 2.5  # ties in the predictions too
    scores = regression_scores(predictions, labels)
    assert scores["pearson"] == pytest.approx(stats.pearsonr(predictions, labels)[0])
    assert scores["spearman"] == pytest.approx(stats.spearmanr(predictions, labels)[0])
    assert scores["mse"] == pytest.approx(np.mean((predictions - labels) ** 2))
