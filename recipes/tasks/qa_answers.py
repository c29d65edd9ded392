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

The predictions are the same as the straightforward loop's (a test checks it on real data) where
logits do not tie; among tied logits both orders are the sort's, not defined by the algorithm.
"""

from __future__ import annotations

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
    both = torch.stack((start_logits, end_logits)).float()  # a new tensor: one top-k for both
    both.masked_fill_(attention_mask == 0, float("-inf"))
    scores, index = both.topk(min(n_best, both.shape[-1]), dim=-1)
    null = both[:, :, 0]
    if left_padded:
        pad = (attention_mask == 0).sum(dim=-1)
        index = index - pad[:, None]
        null = both.gather(2, pad.expand(2, -1)[:, :, None]).squeeze(2)
    return {
        "start_index": index[0],
        "end_index": index[1],
        "start_score": scores[0],
        "end_score": scores[1],
        "null_start": null[0],
        "null_end": null[1],
    }


_FIELDS = ("question", "score", "order", "start_char", "end_char", "start_logit", "end_logit")
_NULL_FIELDS = ("question", "score", "window", "start_logit", "end_logit")


def _grouped_first(
    group: np.ndarray, keys: tuple[np.ndarray, ...], limit: int
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the first ``limit`` rows of every group when each group is sorted by ``keys``
    (the last key most significant, as in ``np.lexsort``), and where each group's run starts."""
    return _first_of_runs(np.lexsort((*keys, group)), group, limit)


def _first_of_runs(
    ranked: np.ndarray, group: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray]:
    """``ranked``: a permutation sorting ``group`` (then anything else); the indices of the first
    ``limit`` rows of each group's run and where each kept run starts."""
    group = group[ranked]
    first = np.r_[True, group[1:] != group[:-1]] if len(group) else np.empty(0, bool)
    start = np.maximum.accumulate(np.where(first, np.arange(len(group)), 0))
    keep = np.arange(len(group)) - start < limit
    kept_group = group[keep]
    bounds = np.flatnonzero(np.r_[True, kept_group[1:] != kept_group[:-1], True])
    return ranked[keep], bounds if len(kept_group) else np.zeros(1, np.int64)


def _rank_spans(spans: Mapping[str, np.ndarray]) -> np.ndarray:
    """The permutation that sorts spans by question, then score (best first), then the order
    the straightforward loop meets them in (its sort is stable).

    One stable sort of a 64-bit key (question, then the score's bits turned into an integer
    that sorts like the float) replaces a three-key ``lexsort``; ties keep the buffer's
    order, which is the loop's order unless batches arrived out of order (then it is restored
    first).
    """
    order = spans["order"]
    by_order = None
    if len(order) > 1 and not (order[1:] > order[:-1]).all():
        by_order = np.argsort(order, kind="stable")
    bits = (spans["score"].astype(np.float32) + np.float32(0.0)).view(np.int32)  # -0.0 -> 0.0
    ascending = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # as int32, in the floats' order
    key = (spans["question"].astype(np.int64) << 32) - ascending  # best score first
    if by_order is None:
        return np.argsort(key, kind="stable")
    return by_order[np.argsort(key[by_order], kind="stable")]


def _grouped_softmax(scores: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Softmax within each run ``bounds[i]:bounds[i + 1]`` of best-first scores (float64, as
    the n-best probabilities of v1)."""
    scores = scores.astype(np.float64)
    first, lengths = bounds[:-1], np.diff(bounds)
    nonempty = lengths > 0
    first, lengths = first[nonempty], lengths[nonempty]
    if not len(first):
        return scores
    shifted = np.exp(scores - np.repeat(scores[first], lengths))  # best first: its max
    return shifted / np.repeat(np.add.reduceat(shifted, first), lengths)


class _WindowOffsets:
    """The evaluation windows' question indices and token character offsets, looked up in place.

    A ``Dataset`` (without an indices mapping) is read where it lies: the list offsets and values
    of its memory-mapped Arrow columns are numpy views, so a lookup copies only the offsets of the
    tokens it asks for, and nothing is held per window. Anything else (a selected ``Dataset``, a
    list of rows) is read a batch of rows at a time.
    """

    def __init__(self, windows: Any) -> None:
        self.windows = windows
        table = getattr(getattr(windows, "data", None), "table", None)
        self._parts: list[tuple[np.ndarray, ...]] | None = None
        if table is not None and getattr(windows, "_indices", None) is None:
            batches = table.select(["offset_mapping", "example_index"]).to_batches()
            self._parts = [self._views(b) for b in batches]
            self._bounds = np.cumsum([0] + [b.num_rows for b in batches])

    @staticmethod
    def _views(batch: Any) -> tuple[np.ndarray, ...]:
        """(window -> first token, token -> its pair, flat offsets, window -> question) as numpy
        views of one Arrow record batch (no copy for the memory-mapped cache)."""
        windows = batch.column("offset_mapping")
        pairs = windows.values  # every token's [start, end] list; ``windows.offsets`` index it
        return (
            windows.offsets.to_numpy(),
            pairs.offsets.to_numpy(),
            pairs.values.to_numpy(zero_copy_only=False),
            batch.column("example_index").to_numpy(zero_copy_only=False),
        )

    def _rows(self, feature_index: np.ndarray) -> tuple[np.ndarray, ...]:
        import pyarrow as pa

        if hasattr(self.windows, "with_format"):
            rows = self.windows.with_format("arrow")[feature_index.tolist()]
        else:
            picked = [self.windows[int(f)] for f in feature_index]
            rows = pa.table(
                {
                    "example_index": [r["example_index"] for r in picked],
                    "offset_mapping": [r["offset_mapping"] for r in picked],
                }
            )
        return self._views(rows.combine_chunks().to_batches()[0])

    def lookup(
        self, feature_index: np.ndarray, start: np.ndarray, end: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For windows ``feature_index`` [n] and token positions ``start``/``end`` [n, k]: the
        question of each window, the start character of each start token, and the start and end
        characters of each end token; -1 where a token is not context (or past the window)."""
        n, k = start.shape
        question = np.empty(n, dtype=np.int64)
        start_char = np.full((n, k), -1, dtype=np.int64)
        end_first = np.full((n, k), -1, dtype=np.int64)
        end_char = np.full((n, k), -1, dtype=np.int64)
        if self._parts is None:
            groups = [(np.arange(n), np.arange(n), self._rows(feature_index))]
        else:
            part = np.searchsorted(self._bounds, feature_index, side="right") - 1
            groups = [
                (rows, feature_index[rows] - self._bounds[p], self._parts[p])
                for p in np.unique(part)
                for rows in [np.flatnonzero(part == p)]
            ]
        for rows, local, (first, pair, flat, example) in groups:
            question[rows] = example[local]
            base, length = first[local][:, None], (first[local + 1] - first[local])[:, None]
            for tokens, outputs in (
                (start[rows], (start_char,)),
                (end[rows], (end_first, end_char)),
            ):
                inside = (tokens >= 0) & (tokens < length)
                at = pair[np.where(inside, base + tokens, 0)]
                for offset, out in enumerate(outputs):
                    out[rows] = np.where(inside, flat[at + offset], -1)
        return question, start_char, end_first, end_char


class AnswerCollector:
    """Accumulates the candidates of evaluation batches and turns them into answers.

    Args:
        windows: the evaluation windows, indexable by a list of window indices (a ``Dataset``)
            and giving per window ``offset_mapping``, the (start, end) character offsets of each
            token in its context with (-1, -1) for tokens that are not context, and
            ``example_index``, the index of its question. Only the offsets of each batch's
            candidate tokens are read, so the offsets of all windows are never held in memory.
        n_best: how many candidates to keep and report per question.
        max_answer_length: longest span, in tokens.
    """

    #: windows whose candidates wait to be scored together (numpy's per-call cost is paid once
    #: per this many windows, not once per evaluation batch)
    pending_windows = 2048
    #: buffered spans beyond which each question's are cut back to its n_best
    compact_rows = 500_000

    def __init__(self, windows: Any, n_best: int = 20, max_answer_length: int = 30) -> None:
        self._offsets = _WindowOffsets(windows)
        self.n_best = n_best
        self.max_answer_length = max_answer_length
        self._pending: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
        self._pending_count = 0
        self._spans: list[dict[str, np.ndarray]] = []  # per scored chunk: its valid spans
        self._nulls: list[dict[str, np.ndarray]] = []  # per scored chunk: each window's null
        self._buffered = self._compacted = 0

    def add(self, batch: Mapping[str, np.ndarray], feature_index: np.ndarray) -> None:
        """Add one batch of :func:`top_candidates` output (as numpy) for windows ``feature_index``."""
        if (
            self._pending
            and batch["start_index"].shape[1] != self._pending[0][0]["start_index"].shape[1]
        ):
            self._score_pending()  # a batch narrower than n_best tokens: chunks need one k
        self._pending.append((batch, np.asarray(feature_index, dtype=np.int64)))
        self._pending_count += len(feature_index)
        if self._pending_count >= self.pending_windows:
            self._score_pending()

    def _score_pending(self) -> None:
        """Turn the pending windows' candidates into their valid spans and null scores."""
        if not self._pending:
            return
        batch = {k: np.concatenate([b[k] for b, _ in self._pending]) for k in self._pending[0][0]}
        feature_index = np.concatenate([f for _, f in self._pending])
        self._pending, self._pending_count = [], 0
        s_idx, e_idx = batch["start_index"], batch["end_index"]
        example_index, start_char, end_first, end_char = self._offsets.lookup(
            feature_index, s_idx, e_idx
        )
        # end - start in [0, max_answer_length): one unsigned comparison
        span = (e_idx.astype(np.int32)[:, None, :] - s_idx.astype(np.int32)[:, :, None]).view(
            np.uint32
        )
        valid = (
            (span < self.max_answer_length)
            & (start_char >= 0)[:, :, None]
            & (end_first >= 0)[:, None, :]
        )
        # Every valid pair is kept (not only a window's n_best): the union's best n_best per
        # question are the same, and a per-window sort costs more than the larger buffer.
        r, i, j = np.nonzero(valid)
        start_score = batch["start_score"].astype(np.float32)
        end_score = batch["end_score"].astype(np.float32)
        self._spans.append(
            {
                "question": example_index[r],
                "score": start_score[r, i] + end_score[r, j],
                # the straightforward loop's order: window, then start rank, then end rank
                "order": (feature_index[r] * self.n_best + i) * self.n_best + j,
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
                "window": feature_index,  # the question's first window wins a tie
                "start_logit": null_start,
                "end_logit": null_end,
            }
        )
        self._buffered += len(r)
        if self._buffered > 2 * self._compacted + self.compact_rows:
            self._compact()

    def _compact(self) -> None:
        spans = self._merged_spans()
        keep, _ = _first_of_runs(_rank_spans(spans), spans["question"], self.n_best)
        keep.sort()  # the buffer stays in arrival order
        self._spans = [{f: v[keep] for f, v in spans.items()}]
        self._nulls = [self._lowest_nulls()]
        self._buffered = self._compacted = len(keep)

    def _merged_spans(self) -> dict[str, np.ndarray]:
        return {f: np.concatenate([p[f] for p in self._spans]) for f in _FIELDS}

    def _lowest_nulls(self) -> dict[str, np.ndarray]:
        """Each question's lowest null score (its first window's on a tie)."""
        nulls = {f: np.concatenate([p[f] for p in self._nulls]) for f in _NULL_FIELDS}
        keep, _ = _grouped_first(nulls["question"], (nulls["window"], nulls["score"]), 1)
        return {f: v[keep] for f, v in nulls.items()}

    def _per_question(self) -> tuple[dict[int, tuple[int, int]], Any, dict[int, tuple]]:
        """Where each question's n_best spans are (rows ``a:b``, best first), a function giving
        those spans' columns as numpy arrays (each made when first asked for), and each
        question's null score."""
        self._score_pending()
        if not self._spans:
            return {}, None, {}
        spans, nulls = self._merged_spans(), self._lowest_nulls()
        keep, bounds = _first_of_runs(_rank_spans(spans), spans["question"], self.n_best)
        ranked: dict[str, np.ndarray] = {}

        def column(name: str) -> np.ndarray:
            if name not in ranked:
                ranked[name] = (
                    _grouped_softmax(column("score"), bounds)  # v1's n-best probabilities
                    if name == "probability"
                    else spans[name][keep]
                )
            return ranked[name]

        nonempty = np.diff(bounds) > 0
        heads, tails = bounds[:-1][nonempty], bounds[1:][nonempty]
        questions = spans["question"][keep[heads]]
        where = dict(
            zip(questions.tolist(), zip(heads.tolist(), tails.tolist(), strict=True), strict=True)
        )
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
        return where, column, null

    def answers(
        self,
        examples: Sequence[Mapping],
        version_2_with_negative: bool = False,
        null_score_diff_threshold: float = 0.0,
        with_nbest: bool = True,
    ) -> tuple[dict[str, str], dict[str, list[dict]], dict[str, float]]:
        """The answer to every question, its n-best list and (v2) its null-score difference.

        Args:
            examples: the evaluation questions, indexable by example index, with ``id`` and
                ``context``.
            with_nbest: build the n-best lists (``nbest`` is empty otherwise; the predictions
                are the same).

        Returns:
            ``predictions`` (id -> text), ``nbest`` (id -> candidates with text, probability,
            start_logit, end_logit) and ``null_odds`` (id -> null score minus best span score;
            empty for v1).
        """
        predictions: dict[str, str] = {}
        nbest: dict[str, list[dict]] = {}
        null_odds: dict[str, float] = {}
        spans = _Spans(*self._per_question())
        for index, (qid, context) in enumerate(zip(*_ids_and_contexts(examples), strict=True)):
            a, b = spans.where.get(index, (0, 0))
            if not version_2_with_negative and b and (b - a > 1 or spans.has_text(a)):
                # v1 with spans: the best one, and the n-best list as it stands (the general
                # path gives the same; this one skips its per-question bookkeeping)
                predictions[qid] = spans.text(context, a)
                if with_nbest:
                    nbest[qid] = spans.nbest(context, a, b)
                continue
            question_null = spans.nulls.get(index)
            ranked = spans.ranked(context, a, b)
            if version_2_with_negative and question_null is not None:
                ranked = self._with_null(ranked, question_null)
            ranked = _with_probabilities(ranked)
            if with_nbest:
                nbest[qid] = ranked
            if not version_2_with_negative:
                predictions[qid] = ranked[0]["text"]
                continue
            null_score = question_null[0] if question_null is not None else 0.0
            predictions[qid], null_odds[qid] = _decide_v2(
                ranked, null_score, null_score_diff_threshold
            )
        return predictions, nbest, null_odds

    def _with_null(self, ranked: list[dict], question_null: tuple) -> list[dict]:
        """The candidates with the null answer in its place by score, kept within ``n_best``."""
        null_score, start_logit, end_logit = question_null
        null = {
            "text": "",
            "score": null_score,
            "start_logit": start_logit,
            "end_logit": end_logit,
            "null": True,
        }
        # The null candidate ranks after spans of equal score (it comes last in the list).
        position = sum(1 for c in ranked if c["score"] >= null_score)
        ranked = [*ranked[:position], null, *ranked[position:]][: self.n_best]
        if not any(c.get("null") for c in ranked):
            ranked.append(null)
        return ranked


def _ids_and_contexts(examples: Sequence[Mapping]) -> tuple[list[str], list[str]]:
    if hasattr(examples, "column_names"):  # a Dataset: two columns, not a row at a time
        columns = examples.select_columns(["id", "context"]).to_dict()
        return columns["id"], columns["context"]
    return [e["id"] for e in examples], [e["context"] for e in examples]


class _Spans:
    """The ranked spans of every question as Python lists, each column made when first used."""

    def __init__(self, where: dict[int, tuple[int, int]], arrays: Any, nulls: dict) -> None:
        self.where, self.nulls = where, nulls
        self._arrays = arrays
        self._columns: dict[str, list] = {}
        self.starts, self.ends = self.column("start_char"), self.column("end_char")

    def column(self, name: str) -> list:
        if name not in self._columns:
            self._columns[name] = self._arrays(name).tolist() if self._arrays else []
        return self._columns[name]

    def has_text(self, row: int) -> bool:
        return self.starts[row] < self.ends[row]

    def text(self, context: str, row: int) -> str:
        return context[self.starts[row] : self.ends[row]]

    def nbest(self, context: str, a: int, b: int) -> list[dict]:
        """Rows ``a:b`` with v1's probabilities (already normalised per question)."""
        return self._records(context, a, b, ("start_logit", "end_logit", "probability"))

    def ranked(self, context: str, a: int, b: int) -> list[dict]:
        """Rows ``a:b`` with their scores (none when the question has no span)."""
        if not b:
            return []
        return self._records(context, a, b, ("score", "start_logit", "end_logit"))

    def _records(self, context: str, a: int, b: int, names: tuple[str, ...]) -> list[dict]:
        """Rows ``a:b`` as {"text", *names}, in that order (the order written to JSON)."""
        columns = [self.column(name)[a:b] for name in names]
        return [
            {"text": context[s:e], **dict(zip(names, values, strict=True))}
            for s, e, *values in zip(self.starts[a:b], self.ends[a:b], *columns, strict=True)
        ]


def _with_probabilities(ranked: list[dict]) -> list[dict]:
    """The candidates' softmax over scores in place of the scores (an ``empty`` candidate
    stands in when nothing but the null answer is left, as the reference does)."""
    if not ranked or (len(ranked) == 1 and ranked[0]["text"] == ""):
        ranked.insert(0, {"text": "empty", "score": 0.0, "start_logit": 0.0, "end_logit": 0.0})
    scores = np.array([c["score"] for c in ranked], dtype=np.float64)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    for candidate, prob in zip(ranked, probs, strict=True):
        candidate["probability"] = float(prob)
        del candidate["score"]
        candidate.pop("null", None)
    return ranked


def _decide_v2(ranked: list[dict], null_score: float, threshold: float) -> tuple[str, float]:
    """SQuAD v2's answer and null-odds: empty when the null beats the best span by more
    than ``threshold``."""
    best = next((c for c in ranked if c["text"] != ""), None)
    if best is None:
        return "", float("inf")
    diff = null_score - best["start_logit"] - best["end_logit"]
    return ("" if diff > threshold else best["text"]), float(diff)
