"""From start/end logits to answer texts, streamed one evaluation batch at a time.

The algorithm is the one of the Hugging Face question-answering examples (``utils_qa.py``): per
window, the ``n_best`` highest start and end logits form candidate spans; spans outside the context,
reversed or longer than ``max_answer_length`` are dropped; per question the best spans over all its
windows are ranked, the "no answer" (null) score of v2 is the lowest CLS score over the windows.
What differs is how it is computed:

* the top-k selection runs on the device, so only ``2 * n_best`` numbers per window leave it
  (never a float64 array of every logit of every window);
* span filtering and scoring are numpy operations over the whole batch (``n_best x n_best`` pairs
  per window at once) instead of two nested Python loops per window;
* per question only the ``n_best`` best spans seen so far are kept, so memory is bounded by the
  number of questions, not by the number of windows times the sequence length.

The predictions are the same as the straightforward loop's (a test checks it on real data).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def top_candidates(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    attention_mask: torch.Tensor,
    n_best: int,
    left_padded: bool = False,
) -> dict[str, torch.Tensor]:
    """The ``n_best`` start and end positions of every window of a batch, on the device.

    Padding positions are excluded (a window's candidates do not depend on how much padding its
    batch happened to get). Positions are returned relative to the unpadded window, which is how
    the offset mappings of the features are stored.

    Returns:
        ``start_index``/``end_index`` (long, [B, k]), ``start_score``/``end_score`` (float, [B, k])
        and ``null_start``/``null_end`` (float, [B]): the logits of the window's first token (CLS),
        whose sum is the window's "no answer" score.
    """
    start = start_logits.float().masked_fill(attention_mask == 0, float("-inf"))
    end = end_logits.float().masked_fill(attention_mask == 0, float("-inf"))
    k = min(n_best, start.shape[-1])
    start_score, start_index = start.topk(k, dim=-1)
    end_score, end_index = end.topk(k, dim=-1)
    first = torch.zeros(start.shape[0], dtype=torch.long, device=start.device)
    if left_padded:
        pad = (attention_mask == 0).sum(dim=-1)
        start_index, end_index, first = start_index - pad[:, None], end_index - pad[:, None], pad
    return {
        "start_index": start_index,
        "end_index": end_index,
        "start_score": start_score,
        "end_score": end_score,
        "null_start": start.gather(1, first[:, None]).squeeze(1),
        "null_end": end.gather(1, first[:, None]).squeeze(1),
    }


_FIELDS = ("question", "score", "order", "start_char", "end_char", "start_logit", "end_logit")
_NULL_FIELDS = ("question", "score", "seen", "start_logit", "end_logit")


def _grouped_first(
    group: np.ndarray, keys: tuple[np.ndarray, ...], limit: int
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the first ``limit`` rows of every group when each group is sorted by ``keys``
    (the last key most significant, as in ``np.lexsort``), and where each group's run starts."""
    ranked = np.lexsort((*keys, group))
    group = group[ranked]
    first = np.r_[True, group[1:] != group[:-1]] if len(group) else np.empty(0, bool)
    start = np.maximum.accumulate(np.where(first, np.arange(len(group)), 0))
    keep = np.arange(len(group)) - start < limit
    kept_group = group[keep]
    bounds = np.flatnonzero(np.r_[True, kept_group[1:] != kept_group[:-1], True])
    return ranked[keep], bounds if len(kept_group) else np.zeros(1, np.int64)


class AnswerCollector:
    """Accumulates the candidates of evaluation batches and turns them into answers.

    Args:
        windows: the evaluation windows, indexable by a list of window indices (a ``Dataset``)
            and giving per window ``offset_mapping``, the (start, end) character offsets of each
            token in its context with (-1, -1) for tokens that are not context, and
            ``example_index``, the index of its question. Only the rows of the current batch are
            read, so the offsets of all windows are never held in memory at once.
        n_best: how many candidates to keep and report per question.
        max_answer_length: longest span, in tokens.
    """

    def __init__(self, windows: Any, n_best: int = 20, max_answer_length: int = 30) -> None:
        self.windows = windows
        # Rows as Arrow tables, not Python lists (a Dataset; plain sequences are read as they are).
        self._arrow = windows.with_format("arrow") if hasattr(windows, "with_format") else None
        self.n_best = n_best
        self.max_answer_length = max_answer_length
        self._spans: list[dict[str, np.ndarray]] = []  # per batch: each window's n_best spans
        self._nulls: list[dict[str, np.ndarray]] = []  # per batch: each window's null score
        self._buffered = self._compacted = 0
        self._seen = 0

    def add(self, batch: Mapping[str, np.ndarray], feature_index: np.ndarray) -> None:
        """Add one batch of :func:`top_candidates` output (as numpy) for windows ``feature_index``."""
        s_idx, e_idx = batch["start_index"], batch["end_index"]
        n, k = s_idx.shape
        feature_index = np.asarray(feature_index, dtype=np.int64)
        example_index, table = self._offsets(feature_index, int(max(s_idx.max(), e_idx.max())) + 1)
        rows = np.arange(n)[:, None]
        start_char = table[rows, s_idx, 0]  # [n, k]; -1 where the token is not context
        end_char = table[rows, e_idx, 1]
        length = e_idx[:, None, :] - s_idx[:, :, None] + 1  # [n, k, k]
        valid = (
            (start_char >= 0)[:, :, None]
            & (table[rows, e_idx, 0] >= 0)[:, None, :]
            & (length >= 1)
            & (length <= self.max_answer_length)
        )
        start_score = batch["start_score"].astype(np.float32)
        end_score = batch["end_score"].astype(np.float32)
        score = (start_score[:, :, None] + end_score[:, None, :]).reshape(n, k * k)
        # A window's n_best spans (best score first, the earlier pair on ties) are all a
        # question can keep from it.
        ranked = np.argsort(
            -np.where(valid.reshape(n, k * k), score, -np.inf), axis=1, kind="stable"
        )
        pick = ranked[:, : self.n_best]
        r = np.repeat(np.arange(n), pick.shape[1])
        c = pick.reshape(-1)
        ok = valid.reshape(n, k * k)[r, c]
        r, c = r[ok], c[ok]
        i, j = c // k, c % k
        self._spans.append(
            {
                "question": example_index[r],
                "score": score[r, c],
                "order": feature_index[r] * k * k + c,
                "start_char": start_char[r, i],
                "end_char": end_char[r, j],
                "start_logit": start_score[r, i],
                "end_logit": end_score[r, j],
            }
        )
        null_start = batch["null_start"].astype(np.float32)
        null_end = batch["null_end"].astype(np.float32)
        self._nulls.append(
            {
                "question": example_index,
                "score": null_start + null_end,
                "seen": self._seen + np.arange(n),  # the first window wins a tie
                "start_logit": null_start,
                "end_logit": null_end,
            }
        )
        self._seen += n
        self._buffered += len(r)
        if self._buffered > 2 * self._compacted + 500_000:  # memory: keep n_best per question
            self._compact()

    def _compact(self) -> None:
        spans = {f: np.concatenate([p[f] for p in self._spans]) for f in _FIELDS}
        keep, _ = _grouped_first(spans["question"], (spans["order"], -spans["score"]), self.n_best)
        self._spans = [{f: v[keep] for f, v in spans.items()}]
        nulls = {f: np.concatenate([p[f] for p in self._nulls]) for f in _NULL_FIELDS}
        keep, _ = _grouped_first(nulls["question"], (nulls["seen"], nulls["score"]), 1)
        self._nulls = [{f: v[keep] for f, v in nulls.items()}]
        self._buffered = self._compacted = len(self._spans[0]["score"])

    def _offsets(self, feature_index: np.ndarray, min_width: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch's question indices and its windows' offsets as one [n, width, 2] array,
        read straight from Arrow (no Python object per token)."""
        import pyarrow.compute as pc

        if self._arrow is not None:
            rows = self._arrow[feature_index.tolist()]
        else:
            import pyarrow as pa

            picked = [self.windows[int(f)] for f in feature_index]
            rows = pa.table(
                {
                    "example_index": [r["example_index"] for r in picked],
                    "offset_mapping": [r["offset_mapping"] for r in picked],
                }
            )
        example_index = rows.column("example_index").to_numpy()
        offsets = rows.column("offset_mapping").combine_chunks()
        lengths = pc.list_value_length(offsets).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(pc.list_flatten(offsets)).to_numpy(zero_copy_only=False)
        n = len(feature_index)
        table = np.full((n, max(int(lengths.max(initial=0)), min_width), 2), -1, dtype=np.int64)
        row_of = np.repeat(np.arange(n), lengths)
        position = np.arange(len(row_of)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        table[row_of, position] = flat.reshape(-1, 2)
        return example_index, table

    def _per_question(self) -> tuple[dict[int, tuple[int, int]], dict, dict[int, tuple]]:
        """Every question's n_best spans (as Python lists, best first) and its null score."""
        if not self._spans:
            return {}, {}, {}
        self._compact()
        spans, nulls = self._spans[0], self._nulls[0]
        keep, bounds = _grouped_first(
            spans["question"], (spans["order"], -spans["score"]), self.n_best
        )
        columns = {f: spans[f][keep].tolist() for f in _FIELDS}
        # Softmax over each question's spans (v1's n-best probabilities; v2 adds its null first).
        scores = spans["score"][keep].astype(np.float64)
        first, lengths = bounds[:-1], np.diff(bounds)
        shifted = np.exp(scores - np.repeat(scores[first], lengths))  # best first: its max
        columns["probability"] = (
            shifted / np.repeat(np.add.reduceat(shifted, first), lengths)
        ).tolist()
        where = {
            columns["question"][a]: (a, b) for a, b in itertools.pairwise(bounds.tolist()) if b > a
        }
        null = {
            q: (sc, sl, el)
            for q, sc, sl, el in zip(
                nulls["question"].tolist(),
                nulls["score"].tolist(),
                nulls["start_logit"].tolist(),
                nulls["end_logit"].tolist(),
                strict=True,
            )
        }
        return where, columns, null

    def answers(
        self,
        examples: Sequence[Mapping],
        version_2_with_negative: bool = False,
        null_score_diff_threshold: float = 0.0,
    ) -> tuple[dict[str, str], dict[str, list[dict]], dict[str, float]]:
        """The answer to every question, its n-best list and (v2) its null-score difference.

        Args:
            examples: the evaluation questions, indexable by example index, with ``id`` and
                ``context``.

        Returns:
            ``predictions`` (id -> text), ``nbest`` (id -> candidates with text, probability,
            start_logit, end_logit) and ``null_odds`` (id -> null score minus best span score;
            empty for v1).
        """
        predictions: dict[str, str] = {}
        nbest: dict[str, list[dict]] = {}
        null_odds: dict[str, float] = {}
        if hasattr(examples, "column_names"):  # a Dataset: two columns, not a row at a time
            columns = examples.select_columns(["id", "context"]).to_dict()
            ids, contexts = columns["id"], columns["context"]
        else:
            ids = [e["id"] for e in examples]
            contexts = [e["context"] for e in examples]
        where, spans, nulls = self._per_question()
        for index, (qid, context) in enumerate(zip(ids, contexts, strict=True)):
            a, b = where.get(index, (0, 0))
            if (
                not version_2_with_negative
                and b
                and (b - a > 1 or spans["start_char"][a] < spans["end_char"][a])
            ):
                # v1 with spans: the n-best list as it stands (the general path below gives the
                # same; this one skips its per-question bookkeeping)
                ranked = [
                    {"text": context[s:e], "start_logit": sl, "end_logit": el, "probability": pr}
                    for s, e, sl, el, pr in zip(
                        spans["start_char"][a:b],
                        spans["end_char"][a:b],
                        spans["start_logit"][a:b],
                        spans["end_logit"][a:b],
                        spans["probability"][a:b],
                        strict=True,
                    )
                ]
                nbest[qid] = ranked
                predictions[qid] = ranked[0]["text"]
                continue
            ranked = [
                {"text": context[s:e], "score": sc, "start_logit": sl, "end_logit": el}
                for s, e, sc, sl, el in zip(
                    spans["start_char"][a:b] if b else (),
                    spans["end_char"][a:b] if b else (),
                    spans["score"][a:b] if b else (),
                    spans["start_logit"][a:b] if b else (),
                    spans["end_logit"][a:b] if b else (),
                    strict=True,
                )
            ]
            question_null = nulls.get(index)
            null_score = question_null[0] if question_null is not None else 0.0
            if version_2_with_negative and question_null is not None:
                null = {
                    "text": "",
                    "score": null_score,
                    "start_logit": question_null[1],
                    "end_logit": question_null[2],
                    "null": True,
                }
                # The null candidate ranks after spans of equal score (it comes last in the list).
                position = sum(1 for c in ranked if c["score"] >= null_score)
                ranked.insert(position, null)
                ranked = ranked[: self.n_best]
                if not any(c.get("null") for c in ranked):
                    ranked.append(null)
            if not ranked or (len(ranked) == 1 and ranked[0]["text"] == ""):
                ranked.insert(
                    0, {"text": "empty", "score": 0.0, "start_logit": 0.0, "end_logit": 0.0}
                )
            scores = np.array([c["score"] for c in ranked], dtype=np.float64)
            probs = np.exp(scores - scores.max())
            probs /= probs.sum()
            for candidate, prob in zip(ranked, probs, strict=True):
                candidate["probability"] = float(prob)
                del candidate["score"]
                candidate.pop("null", None)
            nbest[qid] = ranked
            if not version_2_with_negative:
                predictions[qid] = ranked[0]["text"]
                continue
            best = next((c for c in ranked if c["text"] != ""), None)
            if best is None:
                predictions[qid], null_odds[qid] = "", float("inf")
                continue
            diff = null_score - best["start_logit"] - best["end_logit"]
            null_odds[qid] = float(diff)
            predictions[qid] = "" if diff > null_score_diff_threshold else best["text"]
        return predictions, nbest, null_odds
