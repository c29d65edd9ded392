"""The straightforward answer extraction of the Hugging Face QA examples, as a test oracle.

Per window: the n_best highest start and end logits, two nested Python loops over the pairs,
offsets of non-context tokens are None; per question: sort all candidates, add the null
candidate for v2, softmax, and compare the null score with the best span. The project's
vectorised, streamed version must give exactly the same answers.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def reference_answers(
    examples,
    windows,
    all_start_logits,
    all_end_logits,
    n_best=20,
    max_answer_length=30,
    version_2_with_negative=False,
    null_score_diff_threshold=0.0,
    with_nbest=False,
):
    """``windows``: rows with ``example_index`` and ``offset_mapping`` ((-1, -1) = not context);
    ``all_*_logits``: per window, float32 logits over the unpadded window. ``with_nbest``: also
    build each question's n-best list with probabilities, as the Hugging Face example does for
    its nbest_predictions.json (returned third)."""
    by_example = defaultdict(list)
    for i, window in enumerate(windows):
        by_example[window["example_index"]].append(i)
    predictions, null_odds, nbest = {}, {}, {}
    for index in range(len(examples)):
        example = examples[index]
        min_null, prelim = None, []
        for i in by_example[index]:
            start_logits, end_logits = all_start_logits[i], all_end_logits[i]
            offsets = [None if o[0] < 0 else tuple(o) for o in windows[i]["offset_mapping"]]
            null_score = start_logits[0] + end_logits[0]
            if min_null is None or min_null["score"] > null_score:
                min_null = {
                    "offsets": (0, 0),
                    "score": null_score,
                    "start_logit": start_logits[0],
                    "end_logit": end_logits[0],
                }
            starts = np.argsort(start_logits)[-1 : -n_best - 1 : -1].tolist()
            ends = np.argsort(end_logits)[-1 : -n_best - 1 : -1].tolist()
            for s in starts:
                for e in ends:
                    if s >= len(offsets) or e >= len(offsets):
                        continue
                    if offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    prelim.append(
                        {
                            "offsets": (offsets[s][0], offsets[e][1]),
                            "score": start_logits[s] + end_logits[e],
                            "start_logit": start_logits[s],
                            "end_logit": end_logits[e],
                        }
                    )
        if version_2_with_negative and min_null is not None:
            prelim.append(min_null)
            null_score = min_null["score"]
        ranked = sorted(prelim, key=lambda x: x["score"], reverse=True)[:n_best]
        if (
            version_2_with_negative
            and min_null is not None
            and not any(p is min_null for p in ranked)
        ):
            ranked.append(min_null)
        context = example["context"]
        for p in ranked:
            p["text"] = "" if p is min_null else context[p["offsets"][0] : p["offsets"][1]]
        if not ranked or (len(ranked) == 1 and ranked[0]["text"] == ""):
            ranked.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
        if with_nbest:
            scores = np.array([p["score"] for p in ranked])
            probs = np.exp(scores - np.max(scores))
            probs /= probs.sum()
            nbest[example["id"]] = [
                {
                    "text": p["text"],
                    "probability": float(prob),
                    "start_logit": float(p["start_logit"]),
                    "end_logit": float(p["end_logit"]),
                }
                for p, prob in zip(ranked, probs, strict=True)
            ]
        if not version_2_with_negative:
            predictions[example["id"]] = ranked[0]["text"]
            continue
        best = next(p for p in ranked if p["text"] != "")
        diff = null_score - best["start_logit"] - best["end_logit"]
        null_odds[example["id"]] = float(diff)
        predictions[example["id"]] = "" if diff > null_score_diff_threshold else best["text"]
    if with_nbest:
        return predictions, null_odds, nbest
    return predictions, null_odds
