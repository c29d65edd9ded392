"""Rows that every process computed, brought together on the main process: the one gathering
step of per-batch evaluation. :class:`recipes.tasks.base.Task`'s default ``evaluate`` and the
tasks that score rows of their own call it; :mod:`recipes.evaluation`, which runs every
evaluation on top of the task contract, re-exports it, so the contract needs no import of the
evaluation that uses it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from accelerate import Accelerator


def gather_rows(
    step: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    model: torch.nn.Module,
    loader: Iterable[Any],
    accelerator: Accelerator,
) -> dict[str, torch.Tensor] | None:
    """``step``'s rows of every batch of every process, concatenated on the CPU of the main
    process (None elsewhere); the duplicates that pad the last batch are dropped
    (``gather_for_metrics``)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for batch in loader:
        rows = accelerator.gather_for_metrics(dict(step(model, batch)))
        if accelerator.is_main_process:
            for name, value in rows.items():
                parts.setdefault(name, []).append(value.detach().cpu())
    if not accelerator.is_main_process:
        return None
    return {name: torch.cat(values) for name, values in parts.items()}
