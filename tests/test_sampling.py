"""Length-grouped batches: a permutation per epoch, fixed by (seed, epoch), with little padding."""

from __future__ import annotations

import itertools

import numpy as np

from recipes.data import EpochLengthGroupedSampler


def _padding(order: list[int], lengths: np.ndarray, batch: int) -> int:
    """Pad tokens when each batch is padded to its longest feature."""
    cut = [order[i : i + batch] for i in range(0, len(order), batch)]
    return int(sum(lengths[c].max() * len(c) - lengths[c].sum() for c in cut))


def test_length_grouped_order_is_a_seeded_permutation_with_less_padding():
    lengths = np.random.default_rng(0).integers(20, 384, size=2000)
    sampler = EpochLengthGroupedSampler(8, lengths.tolist(), seed=42)
    first = list(sampler)
    assert sorted(first) == list(range(2000))
    again = EpochLengthGroupedSampler(8, lengths.tolist(), seed=42)
    assert list(again) == first  # another process (or a resumed run) draws the same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    shuffled = np.random.default_rng(1).permutation(2000).tolist()
    assert _padding(first, lengths, 8) < 0.2 * _padding(shuffled, lengths, 8)


def _batch_maxima(order: list[int], lengths: np.ndarray, batch: int) -> list[int]:
    return [int(lengths[order[i : i + batch]].max()) for i in range(0, len(order), batch)]


def _descents(maxima: list[int]) -> float:
    """Share of consecutive batches whose longest feature is not longer than the previous one's."""
    return float(np.mean([b <= a for a, b in itertools.pairwise(maxima)]))


def test_length_grouped_batches_come_in_random_order_longest_first():
    from transformers.trainer_pt_utils import LengthGroupedSampler

    lengths = np.random.default_rng(0).integers(20, 384, size=2054)  # 85 full batches + 14
    ours = list(EpochLengthGroupedSampler(24, lengths.tolist(), seed=42))
    maxima = _batch_maxima(ours, lengths, 24)
    assert maxima[0] == lengths.max()  # an out-of-memory shows at the first step
    assert 0.3 < _descents(maxima[1:-1]) < 0.7  # no long-to-short sweeps: a random order
    # transformers' order runs long-to-short through each megabatch (here four per epoch)
    theirs = list(LengthGroupedSampler(24, lengths=lengths.tolist()))
    assert _descents(_batch_maxima(theirs, lengths, 24)) > 0.9
    # Only the epoch's last batch is short; every full batch holds one sorted group's neighbours.
    assert sorted(ours) == list(range(2054))
    assert lengths[ours[-14:]].tolist() == sorted(lengths[ours[-14:]].tolist(), reverse=True)
    for first in range(0, 85 * 24, 24):
        batch = lengths[ours[first : first + 24]].tolist()
        assert batch == sorted(batch, reverse=True)


def test_length_grouped_sampler_on_tiny_and_empty_data():
    assert list(EpochLengthGroupedSampler(8, [], seed=1)) == []
    assert sorted(EpochLengthGroupedSampler(8, [5, 3, 9], seed=1)) == [0, 1, 2]


def test_the_longest_feature_is_in_the_first_batch_even_from_the_remainder():
    import torch

    # 18 features in batches of 4: groups of one batch each, and a remainder of two, which the
    # epoch's permutation (the sampler's first draw) sometimes fills with the longest feature.
    lengths = list(range(1, 19))
    remainder_held_it = 0
    for seed in range(40):
        order = list(EpochLengthGroupedSampler(4, lengths, seed=seed))
        assert sorted(order) == list(range(18))
        assert 17 in order[:4], seed
        permutation = torch.randperm(18, generator=torch.Generator().manual_seed(seed))
        remainder_held_it += 17 in permutation[-2:].tolist()
    assert remainder_held_it > 0  # the case happened


def test_smaller_length_groups_mix_more_and_save_less_padding():
    lengths = np.random.default_rng(0).integers(20, 384, size=4000)
    shuffled = np.random.default_rng(1).permutation(4000).tolist()
    padding = {
        k: _padding(list(EpochLengthGroupedSampler(8, lengths, seed=3, megabatch=k)), lengths, 8)
        for k in (1, 8, 50)
    }
    # one batch per group: batches are random draws (only their inner order is sorted)
    assert padding[1] > 0.8 * _padding(shuffled, lengths, 8)
    assert padding[50] < padding[8] < 0.5 * padding[1]
