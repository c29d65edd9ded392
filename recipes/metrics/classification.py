"""GLUE's metrics: accuracy, F1, Matthews correlation, Pearson and Spearman correlation.

Written out in numpy rather than taken from ``evaluate.load("glue", ...)`` because that fetches
its script from the Hub (runs must work offline), and scikit-learn / scipy, which have them, are
not dependencies of this project. ``tests/test_classification_metrics.py`` checks every function
against scikit-learn and scipy.
"""

from __future__ import annotations

import numpy as np


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(predictions == labels)) if len(labels) else 0.0


def f1(predictions: np.ndarray, labels: np.ndarray, num_labels: int) -> float:
    """Binary F1 of class 1 for two classes (GLUE's MRPC / QQP), else macro F1."""
    classes = [1] if num_labels == 2 else list(range(num_labels))
    scores = []
    for c in classes:
        tp = np.sum((predictions == c) & (labels == c))
        predicted, actual = np.sum(predictions == c), np.sum(labels == c)
        scores.append(2 * tp / (predicted + actual) if predicted + actual else 0.0)
    return float(np.mean(scores))


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray, num_labels: int) -> float:
    """Multi-class Matthews correlation (Gorodkin's R_K), 0 when undefined."""
    confusion = np.zeros((num_labels, num_labels), dtype=np.float64)
    np.add.at(confusion, (labels, predictions), 1)
    t, p = confusion.sum(axis=1), confusion.sum(axis=0)
    n, correct = confusion.sum(), np.trace(confusion)
    denominator = np.sqrt((n * n - p @ p) * (n * n - t @ t))
    return float((correct * n - t @ p) / denominator) if denominator else 0.0


def pearson(predictions: np.ndarray, labels: np.ndarray) -> float:
    x, y = predictions - predictions.mean(), labels - labels.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / denominator) if denominator else 0.0


def _ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    average = (starts + ends + 1) / 2.0  # mean of the 1-based positions starts+1 .. ends
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(average, ends - starts)
    return ranks


def spearman(predictions: np.ndarray, labels: np.ndarray) -> float:
    return pearson(_ranks(predictions), _ranks(labels))


def classification_scores(
    predictions: np.ndarray, labels: np.ndarray, num_labels: int
) -> dict[str, float]:
    return {
        "accuracy": accuracy(predictions, labels),
        "f1": f1(predictions, labels, num_labels),
        "matthews_correlation": matthews_corrcoef(predictions, labels, num_labels),
    }


def regression_scores(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    return {
        "pearson": pearson(predictions, labels),
        "spearman": spearman(predictions, labels),
        "mse": float(np.mean((predictions - labels) ** 2)) if len(labels) else 0.0,
    }
