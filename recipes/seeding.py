"""Randomness that depends on where a run is, not on what ran before in this process.

Exact continuation from a checkpoint needs it: :func:`reseed` seeds each micro-batch from (seed,
rank, epoch, batch), and :class:`SeededCollator` draws a batch's random choices (masking) from its
content, so a resumed run repeats the uninterrupted one step for step.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

import numpy as np
import torch


def reseed(seed: int, rank: int, epoch: int, batch: int) -> None:
    """Seed torch (every device) for one micro-batch from where the run is: dropout then
    depends on the position alone, so a resumed run draws what the uninterrupted one drew."""
    words = np.random.SeedSequence([seed, rank, epoch, batch]).generate_state(2, np.uint32)
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))


class SeededCollator:
    """A collator whose random choices (MLM masking) come from the batch's content and the epoch,
    not from the global RNG stream (which the DataLoader's prefetching makes depend on history)."""

    def __init__(self, collate: Callable[[list[dict]], dict], seed: int) -> None:
        self.collate = collate
        self.seed = seed
        self.epoch = 0

    def start_epoch(self, seed: int, epoch: int) -> None:
        """The loop's call before each epoch (``recipes.tasks.base.SeedsRows``)."""
        self.seed, self.epoch = seed, epoch

    def __call__(self, features: list[dict]) -> dict:
        digest = 0
        for feature in features:
            ids = np.asarray(feature["input_ids"], dtype=np.int64)
            digest = zlib.crc32(ids.tobytes(), digest)
        words = np.random.SeedSequence([self.seed, self.epoch, digest]).generate_state(2)
        seed = int(words[0]) << 32 | int(words[1])
        # torch for transformers' MLM collator; random and numpy for the whole-word one of
        # transformers < 4.56. The global streams are left as they were.
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                random.seed(seed)
                np.random.seed(seed % 2**32)
                return self.collate(features)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
