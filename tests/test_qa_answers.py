"""The streamed, vectorised answer extraction equals the straightforward algorithm."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_task
from qa_reference import reference_answers

from recipes.config import ASSETS, DataConfig
from recipes.tasks.qa_answers import AnswerCollector, top_candidates


def _streamed(
    data,
    start_logits,
    end_logits,
    batch_size,
    n_best,
    max_len,
    v2,
    threshold,
    shuffle=False,
    with_nbest=True,
    **settings,
):
    """Run the project's path: padded batches -> top_candidates -> AnswerCollector.

    ``shuffle``: feed the batches in a random order (as ranks' gathered batches may come);
    ``settings``: AnswerCollector attributes (pending_windows, compact_rows)."""
    collector = AnswerCollector(data.eval_windows, n_best, max_len)
    for name, value in settings.items():
        setattr(collector, name, value)
    order = np.arange(len(start_logits))
    batches = [order[first : first + batch_size] for first in range(0, len(order), batch_size)]
    if shuffle:
        np.random.default_rng(0).shuffle(batches)
    for idx in batches:
        width = max(len(start_logits[i]) for i in idx) + 5  # extra padding must not matter
        start = torch.full((len(idx), width), 7.0)  # padding logits are high on purpose
        end = torch.full((len(idx), width), 7.0)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            n = len(start_logits[i])
            start[row, :n], end[row, :n] = (
                torch.from_numpy(start_logits[i]),
                torch.from_numpy(end_logits[i]),
            )
            mask[row, :n] = 1
        cands = top_candidates(start, end, mask, n_best)
        collector.add({k: v.numpy() for k, v in cands.items()}, idx)
    return collector.answers(data.eval_examples, v2, threshold, with_nbest=with_nbest)


def _random_logits(windows, seed):
    rng = np.random.default_rng(seed)
    lengths = [len(o) for o in windows["offset_mapping"]]
    return (
        [rng.normal(size=n).astype(np.float32) for n in lengths],
        [rng.normal(size=n).astype(np.float32) for n in lengths],
    )


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS / "tiny-bert")


_BUILT: dict[int, tuple] = {}


def _data(tokenizer, tmp_path_factory, version):
    """The bundled SQuAD v1 / v2 slice's task and data, built once per version for the module
    (the tests read its windows and examples, and change neither)."""
    if version not in _BUILT:
        task = make_task(
            "qa",
            max_seq_length=96,
            doc_stride=32,
            max_query_length=32,
            version_2_with_negative=version == 2,
        )
        cache = tmp_path_factory.mktemp("cache")
        cfg = DataConfig(path=str(ASSETS / "squad" / f"v{version}"), cache_dir=str(cache))
        _BUILT[version] = task, task.build_data(cfg, tokenizer)
    return _BUILT[version]


@pytest.mark.parametrize("n_best,max_len,batch_size", [(20, 30, 16), (5, 8, 7)])
def test_v1_matches_reference(tokenizer, tmp_path_factory, n_best, max_len, batch_size):
    _, data = _data(tokenizer, tmp_path_factory, 1)
    windows = data.eval_windows
    assert len(windows) > len(data.eval_examples)  # several windows per question are exercised
    start, end = _random_logits(windows, seed=n_best)
    expected, _ = reference_answers(data.eval_examples, windows, start, end, n_best, max_len)
    got, nbest, _ = _streamed(data, start, end, batch_size, n_best, max_len, False, 0.0)
    assert got == expected
    assert all(len(v) <= n_best for v in nbest.values())
    first = next(iter(nbest.values()))
    assert abs(sum(c["probability"] for c in first) - 1.0) < 1e-6


@pytest.mark.parametrize("threshold", [0.0, 1.5, -1.0])
def test_v2_matches_reference(tokenizer, tmp_path_factory, threshold):
    _, data = _data(tokenizer, tmp_path_factory, 2)
    windows = data.eval_windows
    start, end = _random_logits(windows, seed=3)
    for i, example_index in enumerate(windows["example_index"]):
        if example_index % 3 == 0:  # make "no answer" win for some questions
            start[i][0] += 3.0
            end[i][0] += 3.0
    expected, expected_odds = reference_answers(
        data.eval_examples,
        windows,
        start,
        end,
        version_2_with_negative=True,
        null_score_diff_threshold=threshold,
    )
    got, _, odds = _streamed(data, start, end, 16, 20, 30, True, threshold)
    assert got == expected
    assert odds.keys() == expected_odds.keys()
    assert all(abs(odds[k] - expected_odds[k]) < 1e-5 for k in odds)
    assert 0 < sum(1 for v in got.values() if v == "") < len(got)  # both kinds of answers occur


@pytest.mark.parametrize("version", [1, 2])
def test_chunks_compaction_and_batch_order_do_not_change_answers(
    tokenizer, tmp_path_factory, version
):
    """Scoring a few windows at a time, cutting the buffer back to n_best per question as it
    goes, and batches arriving out of order give the reference's answers and n-best lists."""
    _, data = _data(tokenizer, tmp_path_factory, version)
    windows = data.eval_windows
    start, end = _random_logits(windows, seed=5)
    v2 = version == 2
    expected, expected_odds, expected_nbest = reference_answers(
        data.eval_examples, windows, start, end, 7, 30, v2, 0.0, with_nbest=True
    )
    got, nbest, odds = _streamed(
        data, start, end, 5, 7, 30, v2, 0.0, shuffle=True, pending_windows=11, compact_rows=40
    )
    assert got == expected
    assert odds.keys() == expected_odds.keys()
    assert nbest.keys() == expected_nbest.keys()
    for qid, ranked in nbest.items():
        want = expected_nbest[qid]
        assert [c["text"] for c in ranked] == [c["text"] for c in want], qid
        for ours, theirs in zip(ranked, want, strict=True):
            assert abs(ours["probability"] - theirs["probability"]) < 1e-6
            assert abs(ours["start_logit"] - theirs["start_logit"]) < 1e-6
            assert abs(ours["end_logit"] - theirs["end_logit"]) < 1e-6
    plain, no_nbest, _ = _streamed(data, start, end, 5, 7, 30, v2, 0.0, with_nbest=False)
    assert plain == expected and no_nbest == {}


def test_true_answers_are_extracted(tokenizer, tmp_path_factory):
    """Logits that peak on the gold span give the gold answer text (through all windows)."""
    _, data = _data(tokenizer, tmp_path_factory, 1)
    windows, examples = data.eval_windows, data.eval_examples
    start, end = _random_logits(windows, seed=0)
    for i, window in enumerate(windows):
        example = examples[window["example_index"]]
        s_char = example["answers"]["answer_start"][0]
        e_char = s_char + len(example["answers"]["text"][0])
        offsets = window["offset_mapping"]
        tokens = [k for k, (a, b) in enumerate(offsets) if a >= 0 and a < e_char and b > s_char]
        if tokens and offsets[tokens[0]][0] <= s_char and offsets[tokens[-1]][1] >= e_char:
            start[i][tokens[0]] += 20
            end[i][tokens[-1]] += 20
    got, _, _ = _streamed(data, start, end, 32, 20, 30, False, 0.0)
    exact = sum(got[ex["id"]] == ex["answers"]["text"][0] for ex in examples)
    assert exact / len(examples) > 0.95


@pytest.mark.slow  # the whole SQuAD dev part: tens of seconds
@pytest.mark.shared_data
def test_full_dev_part1_matches_reference(tokenizer, shared_data, tmp_path):
    """All 4,961 questions of the real dev file, windows of the reference settings."""
    task = make_task("qa", max_seq_length=384, doc_stride=128)
    cfg = DataConfig(
        path=str(shared_data / "squad"),
        eval_file=str(shared_data / "squad" / "dev-v1.1-part1.json"),
        train_file=str(ASSETS / "squad" / "v1" / "train.json"),
        cache_dir=str(tmp_path),
    )
    data = task.build_data(cfg, tokenizer)
    assert len(data.eval_examples) == 4961
    start, end = _random_logits(data.eval_windows, seed=11)
    expected, _ = reference_answers(data.eval_examples, data.eval_windows, start, end)
    got, _, _ = _streamed(data, start, end, 64, 20, 30, False, 0.0)
    assert got == expected


def test_left_padded_batches_give_the_same_candidates():
    """Decoder tokenizers pad on the left; positions come back relative to the unpadded window."""
    rng = np.random.default_rng(0)
    lengths = [9, 5, 7]  # at least k = 5 real tokens each (past that, -inf ties are arbitrary)
    width = max(lengths) + 2
    start, end = rng.normal(size=(2, len(lengths), width)).astype(np.float32)
    right_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    left_start, left_end = np.zeros_like(start), np.zeros_like(end)
    for row, n in enumerate(lengths):
        left_start[row, width - n :], left_end[row, width - n :] = start[row, :n], end[row, :n]
    right = top_candidates(torch.from_numpy(start), torch.from_numpy(end), right_mask, 5)
    left = top_candidates(
        torch.from_numpy(left_start), torch.from_numpy(left_end), right_mask.flip(1), 5, True
    )
    for key in right:
        assert torch.equal(right[key], left[key]), key
    assert torch.equal(right["null_start"], torch.from_numpy(start[:, 0]))
