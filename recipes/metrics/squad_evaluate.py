"""Offline `evaluate` metric for SQuAD v1.1 ("squad") and SQuAD v2.0 ("squad_v2").

The Hub metrics ``evaluate.load("squad")`` and ``evaluate.load("squad_v2")`` need network
access. This local script takes the same inputs and delegates the scoring to
``recipes.metrics.squad``, which follows the official evaluation scripts. Load it by path::

    metric = evaluate.load("/abs/path/to/recipes/metrics/squad_evaluate.py", "squad_v2")

``evaluate`` copies this file into its modules cache before importing it, so everything it
needs is imported from the installed ``recipes`` package by absolute import.
"""

from __future__ import annotations

import datasets
import evaluate

from recipes.metrics.squad import squad_v1, squad_v2

_CITATION = """\
@inproceedings{Rajpurkar2016SQuAD10,
  title={SQuAD: 100,000+ Questions for Machine Comprehension of Text},
  author={Pranav Rajpurkar and Jian Zhang and Konstantin Lopyrev and Percy Liang},
  booktitle={EMNLP},
  year={2016}
}
@inproceedings{Rajpurkar2018KnowWY,
  title={Know What You Don't Know: Unanswerable Questions for SQuAD},
  author={Pranav Rajpurkar and Robin Jia and Percy Liang},
  booktitle={ACL},
  year={2018}
}
"""

_DESCRIPTION = """\
Exact match and F1 of the official SQuAD v1.1 and v2.0 evaluation scripts, computed offline.
Config "squad" (the default) scores SQuAD v1.1; config "squad_v2" scores SQuAD v2.0, where
questions may be unanswerable and "" predicts "no answer".
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of dicts with "id" and "prediction_text"; for "squad_v2" optionally also
        "no_answer_probability" (all predictions or none; none means 0.0 for every question).
    references: list of dicts with "id" and "answers" = {"text": [...], "answer_start": [...]};
        for "squad_v2" an empty "text" list marks an unanswerable question.
    no_answer_threshold: "squad_v2" only; a question whose no-answer probability is strictly
        above it counts as predicted unanswerable (default 1.0).
Returns:
    "squad": exact_match, f1 (percentages) and total.
    "squad_v2": exact_match (also under the Hub metric's name "exact"), f1, total, HasAns_exact,
        HasAns_f1, HasAns_total, NoAns_exact, NoAns_f1, NoAns_total (each subset only when it is
        non-empty), best_exact, best_exact_thresh, best_f1, best_f1_thresh.
Examples:
    >>> predictions = [{"id": "q1", "prediction_text": "1976"}]
    >>> references = [{"id": "q1", "answers": {"text": ["1976"], "answer_start": [97]}}]
    >>> metric.compute(predictions=predictions, references=references)["exact_match"]
    100.0
"""

_ANSWERS = datasets.Sequence(
    {"text": datasets.Value("string"), "answer_start": datasets.Value("int32")}
)
_REFERENCES = {"id": datasets.Value("string"), "answers": _ANSWERS}


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SquadEvaluate(evaluate.Metric):
    """SQuAD v1.1 / v2.0 metric for ``evaluate.load`` that needs no Hub access."""

    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in ("default", "squad", "squad_v2"):
            raise ValueError(
                f"unknown config {self.config_name!r}: use 'squad' (SQuAD v1.1) or 'squad_v2'"
            )
        prediction = {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")}
        if self.config_name == "squad_v2":
            # float64 rather than the Hub metric's float32 so the thresholds come back exactly
            # as given and match the pure-Python functions bit for bit.
            prediction["no_answer_probability"] = datasets.Value("float64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": prediction, "references": _REFERENCES}),
            codebase_urls=["https://rajpurkar.github.io/SQuAD-explorer/"],
            reference_urls=["https://rajpurkar.github.io/SQuAD-explorer/"],
        )

    def _fill_probability(self, prediction: dict) -> dict:
        # `datasets` feature checks reject a dict that lacks a declared key, so the optional
        # "no_answer_probability" is filled with None (= not given) before they run.
        if self.config_name != "squad_v2":
            if "no_answer_probability" in prediction:
                # Otherwise `datasets` fails with a bare KeyError; SQuAD v1.1 has no such input.
                raise ValueError("'no_answer_probability' is a 'squad_v2' input; load that config")
            return prediction
        if "no_answer_probability" in prediction:
            return prediction
        return {**prediction, "no_answer_probability": None}

    def add_batch(self, *, predictions=None, references=None, **kwargs) -> None:
        """Adds a batch of predictions and references (see `evaluate.Metric.add_batch`)."""
        if predictions is not None:
            predictions = [self._fill_probability(p) for p in predictions]
        super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction=None, reference=None, **kwargs) -> None:
        """Adds one prediction and reference (see `evaluate.Metric.add`)."""
        if prediction is not None:
            prediction = self._fill_probability(prediction)
        super().add(prediction=prediction, reference=reference, **kwargs)

    def _compute(
        self,
        predictions: list[dict],
        references: list[dict],
        no_answer_threshold: float = 1.0,
    ) -> dict[str, float]:
        """Scores the accumulated predictions against the references.

        Args:
            predictions: Dicts with "id", "prediction_text" (and "no_answer_probability").
            references: Dicts with "id" and "answers" {"text", "answer_start"}.
            no_answer_threshold: No-answer probability threshold ("squad_v2" only).

        Returns:
            The scores of ``recipes.metrics.squad.squad_v1`` or ``squad_v2``.
        """
        preds = {p["id"]: p["prediction_text"] for p in predictions}
        refs = {r["id"]: list(r["answers"]["text"]) for r in references}
        if self.config_name != "squad_v2":
            return squad_v1(preds, refs)

        # A prediction without the optional field is encoded as None by `datasets`.
        probs = {p["id"]: p.get("no_answer_probability") for p in predictions}
        given = [v is not None for v in probs.values()]
        if any(given) and not all(given):
            raise ValueError(
                "give 'no_answer_probability' for every prediction or for none "
                f"({sum(given)} of {len(given)} have it)"
            )
        result = squad_v2(
            preds,
            refs,
            no_answer_probs=probs if all(given) else None,
            no_answer_threshold=no_answer_threshold,
        )
        # Code written for the Hub "squad_v2" metric reads "exact".
        return {"exact": result["exact_match"], **result}
