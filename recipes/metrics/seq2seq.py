"""Generation metrics as run_summarization / run_translation report them: ROUGE and sacreBLEU.

ROUGE goes through the ``rouge-score`` library with ``use_stemmer=True`` (evaluate's ``rouge``).
ROUGE-Lsum scores newline-separated sentences; run_summarization splits them with nltk's punkt,
which needs a data download, so both sides here are split with pysbd, which splits as trained
punkt does at abbreviations ("Mr.", "p.m.", "U.S."). Only rougeLsum depends on the splitter.
We report the plain mean of the per-row F-measures; evaluate reports the median of 1,000
unseeded bootstrap resamples of that mean, which differs from it by about 1e-4 (x100: 1e-2).
BLEU and chrF are sacrebleu's corpus scores with its defaults (13a tokenizer, exp smoothing),
as evaluate's ``sacrebleu`` computes BLEU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@functools.cache
def _segmenter():
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


def split_sentences(text: str) -> str:
    """One sentence a line, as run_summarization's ``"\\n".join(nltk.sent_tokenize(text))``."""
    text = text.strip()
    if not text:
        return ""
    return "\n".join(s.strip() for s in _segmenter().segment(text) if s.strip())


@functools.cache
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)


def _as_lists(references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    return [[r] if isinstance(r, str) else list(r) for r in references]


def _check_lengths(predictions: Sequence[str], references: Sequence) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")


def rouge_scores(
    predictions: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]
) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F-measures x100, the mean over rows.

    A row with several references scores against the best of them for each ROUGE type, as
    ``RougeScorer.score_multi`` does (evaluate's rouge with a list of references per row).
    """
    _check_lengths(predictions, references)
    if not predictions:
        return {k: 0.0 for k in ROUGE_TYPES}
    scorer = _scorer()
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for prediction, refs in zip(predictions, _as_lists(references), strict=True):
        if not refs:
            raise ValueError("a row has no reference")
        scores = scorer.score_multi([split_sentences(r) for r in refs], split_sentences(prediction))
        for k in ROUGE_TYPES:
            totals[k] += scores[k].fmeasure
    return {k: 100.0 * totals[k] / len(predictions) for k in ROUGE_TYPES}


def bleu_scores(
    predictions: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]
) -> dict[str, float]:
    """sacrebleu's corpus BLEU and chrF (0-100); rows may have different numbers of references."""
    import sacrebleu

    _check_lengths(predictions, references)
    if not predictions:
        return {"bleu": 0.0, "chrf": 0.0}
    rows = _as_lists(references)
    if any(not refs for refs in rows):
        raise ValueError("a row has no reference")
    width = max(len(refs) for refs in rows)
    # sacrebleu takes one stream per reference position; None marks a row's missing reference.
    streams = [[refs[i] if i < len(refs) else None for refs in rows] for i in range(width)]
    predictions = list(predictions)
    return {
        "bleu": float(sacrebleu.corpus_bleu(predictions, streams).score),
        "chrf": float(sacrebleu.corpus_chrf(predictions, streams).score),
    }
