"""The loop's stopwatch: evaluation and saving (run inside ``paused``) are not training time."""

from __future__ import annotations

import time

import pytest

from recipes.window import Stopwatch


def test_paused_time_is_left_out_even_when_the_block_raises() -> None:
    watch = Stopwatch()
    time.sleep(0.05)
    with watch.paused():
        time.sleep(0.5)
    with pytest.raises(RuntimeError), watch.paused():
        time.sleep(0.5)
        raise RuntimeError("an evaluation failed")
    assert 0.05 <= watch.elapsed() < 0.45  # the pauses alone took 1 s
    watch.restart()
    assert watch.elapsed() < 0.05
