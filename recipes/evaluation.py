"""Evaluation, owned by the loop: one place switches the model to eval mode and back, turns off
autograd, gathers what every process computed, scores it on the main process and gives every
process the scores. A task supplies a per-batch step and a scoring function, or, where it
evaluates whole (by generating), its own ``evaluate`` (:class:`recipes.tasks.base.Task`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import broadcast_object_list

# Moved to recipes.gathering (what tasks/base.py shares with this module); tasks import it here.
from recipes.gathering import gather_rows as gather_rows

if TYPE_CHECKING:
    from recipes.tasks.base import RunContext, Task, TaskData


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode without autograd, back in the mode it was in afterwards (also when
    the evaluation fails or is stopped)."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(training)


def evaluate(
    task: Task,
    model: torch.nn.Module,
    loader: Iterable[Any],
    data: TaskData,
    run: RunContext,
) -> dict[str, float]:
    """The task's scores of ``model`` on ``loader`` as logged (``eval/<name>``, and
    ``eval/runtime_s``), the same on every process."""
    started = time.perf_counter()
    with eval_mode(model):
        metrics = task.evaluate(model, loader, data, run)
    metrics = broadcast_object_list([metrics if run.accelerator.is_main_process else None])[0]
    scores = {f"eval/{k}": v for k, v in metrics.items()}
    scores["eval/runtime_s"] = time.perf_counter() - started
    return scores
