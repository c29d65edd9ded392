"""ROUGE and sacreBLEU as run_summarization / run_translation compute them, on real rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
from rouge_score import rouge_scorer, scoring

from recipes.metrics.seq2seq import ROUGE_TYPES, bleu_scores, rouge_scores, split_sentences

SCITLDR_DEV = Path(__file__).resolve().parent.parent / "recipes/assets/scitldr/dev.jsonl"


@pytest.fixture(scope="module")
def scitldr_rows() -> list[dict]:
    rows = [json.loads(line) for line in SCITLDR_DEV.read_text(encoding="utf-8").splitlines()]
    return rows[:120]


def lead_words(text: str, n: int = 30) -> str:
    """A lead baseline summary: the abstract's first n words (sentences and abbreviations kept)."""
    return " ".join(text.split()[:n])


def test_rouge_matches_rouge_score_on_real_rows(scitldr_rows):
    predictions = [lead_words(r["source"]) for r in scitldr_rows]
    references = [r["targets"] for r in scitldr_rows]
    ours = rouge_scores(predictions, references)

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    aggregator = scoring.BootstrapAggregator()
    per_row = []
    for prediction, refs in zip(predictions, references, strict=True):
        scores = scorer.score_multi([split_sentences(r) for r in refs], split_sentences(prediction))
        aggregator.add_scores(scores)
        per_row.append(scores)
    for k in ROUGE_TYPES:
        mean = 100 * np.mean([s[k].fmeasure for s in per_row])
        assert ours[k] == pytest.approx(mean, abs=1e-9)
    # evaluate's rouge reports the bootstrap median (unseeded resamples): close to the plain
    # mean, not equal to it; on these rows it has come within 0.11 of it.
    median = aggregator.aggregate()
    for k in ROUGE_TYPES:
        assert abs(ours[k] - 100 * median[k].mid.fmeasure) < 0.5
    assert 10 < ours["rouge1"] < 60 and ours["rouge2"] < ours["rouge1"]


def test_single_reference_strings_equal_one_element_lists(scitldr_rows):
    predictions = [lead_words(r["source"], 20) for r in scitldr_rows[:30]]
    targets = [r["target"] for r in scitldr_rows[:30]]
    assert rouge_scores(predictions, targets) == rouge_scores(predictions, [[t] for t in targets])


def test_several_references_take_the_best_per_rouge_type():
    prediction = "the cat sat on the mat"
    good, bad = "the cat is on the mat", "a dog barked"
    both = rouge_scores([prediction], [[bad, good]])
    assert both == rouge_scores([prediction], [good])
    assert both["rouge1"] > rouge_scores([prediction], [bad])["rouge1"]


def test_hand_checked_rouge():
    # unigrams 5 of 6 in common, bigrams 3 of 5 ("the cat", "on the", "the mat"),
    # longest common subsequence "the cat on the mat" (5 of 6).
    scores = rouge_scores(["The cat sat on the mat."], ["the cat is on the mat"])
    assert scores["rouge1"] == pytest.approx(500 / 6)
    assert scores["rouge2"] == pytest.approx(60.0)
    assert scores["rougeL"] == pytest.approx(500 / 6)
    assert scores["rougeLsum"] == pytest.approx(500 / 6)
    # The Porter stemmer (use_stemmer=True, words over 3 characters) makes these equal.
    assert rouge_scores(["cats running"], ["cat runs"])["rouge1"] == pytest.approx(100.0)


def test_rouge_lsum_scores_sentences_split_on_both_sides():
    # Same sentences in the other order: the sequence-level LCS is half, the summary-level one
    # (per reference sentence, over the prediction's sentences) is whole.
    scores = rouge_scores(
        ["Alpha beta gamma. Delta epsilon zeta."], ["Delta epsilon zeta. Alpha beta gamma."]
    )
    assert scores["rougeL"] == pytest.approx(50.0)
    assert scores["rougeLsum"] == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        # What punkt's trained English model gives (run_summarization's nltk.sent_tokenize); an
        # untrained splitter or a plain regex breaks after "Mr.", "p.m.", "Jan." and "U.S.".
        (
            "Mr. Smith went to Washington. He arrived at 3 p.m. on Jan. 5. The U.S. Senate met! "
            "Did it? Yes.",
            [
                "Mr. Smith went to Washington.",
                "He arrived at 3 p.m. on Jan. 5.",
                "The U.S. Senate met!",
                "Did it?",
                "Yes.",
            ],
        ),
        (
            "We follow Smith et al. (2019) and use e.g. BERT. Results improve by 3.5 points.",
            ["We follow Smith et al. (2019) and use e.g. BERT.", "Results improve by 3.5 points."],
        ),
        (
            "The model (Fig. 2) has 3 layers, i.e. it is small. It runs fast.",
            ["The model (Fig. 2) has 3 layers, i.e. it is small.", "It runs fast."],
        ),
        ("  ", []),
    ],
)
def test_sentence_split_keeps_abbreviations(text, sentences):
    assert split_sentences(text) == "\n".join(sentences)


def test_bleu_and_chrf_match_sacrebleu_on_real_rows(scitldr_rows):
    rows = [r for r in scitldr_rows if len(r["targets"]) >= 2]
    hypotheses = [r["targets"][0] for r in rows]
    others = [r["targets"][1:] for r in rows]  # 1 to several references per row
    second = [refs[0] for refs in others]
    ours = bleu_scores(hypotheses, second)
    assert ours["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [second]).score)
    assert ours["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [second]).score)
    assert len({len(refs) for refs in others}) > 1
    width = max(len(refs) for refs in others)
    streams = [[refs[i] if i < len(refs) else None for refs in others] for i in range(width)]
    several = bleu_scores(hypotheses, others)
    assert several["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, streams).score)
    assert several["bleu"] > ours["bleu"]


def test_hand_checked_bleu():
    # sacrebleu's README example: BLEU = 48.53 with two references per row.
    hypotheses = ["The dog bit the man.", "It wasn't surprising.", "The man had just bitten him."]
    first = ["The dog bit the man.", "It was not unexpected.", "The man bit him first."]
    second = ["The dog had bit the man.", "No one was surprised.", "The man had bitten the dog."]
    scores = bleu_scores(hypotheses, [list(pair) for pair in zip(first, second, strict=True)])
    assert scores["bleu"] == pytest.approx(48.53, abs=0.005)
    assert scores["chrf"] == pytest.approx(59.73, abs=0.005)
    perfect = bleu_scores(first, first)
    assert perfect == {"bleu": pytest.approx(100.0), "chrf": pytest.approx(100.0)}
    # A reference given twice counts once (clipped counts take the maximum, not the sum).
    assert bleu_scores(hypotheses, [[r, r] for r in first]) == bleu_scores(hypotheses, first)


def test_refusals_and_empty_input():
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        rouge_scores(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no reference"):
        bleu_scores(["a"], [[]])
    assert rouge_scores([], []) == dict.fromkeys(ROUGE_TYPES, 0.0)
    assert bleu_scores([], []) == {"bleu": 0.0, "chrf": 0.0}
