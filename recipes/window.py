"""What the loop counts between two log steps: running sums of the loss, tokens and samples on the
device (:class:`Window`) and the training time they took (:class:`Stopwatch`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from accelerate import Accelerator


class Stopwatch:
    """Training time since the last :meth:`restart`; what runs inside :meth:`paused`
    (evaluation, saving) is left out, so throughput counts training alone."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def restart(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    @contextmanager
    def paused(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began


@dataclass
class Window:
    """Running sums between two log steps.

    Loss and token count stay on the device (no host sync per step); micro-batch and sample
    counts are known on the host.
    """

    loss_and_tokens: torch.Tensor  # summed loss, tokens, loss terms
    micro_batches: int
    samples: int
    stats: dict[str, torch.Tensor]  # the task's own sums over its loss terms (LossShape.stats)

    @classmethod
    def fresh(
        cls, where: torch.device, names: tuple[str, ...] = (), saved: list[float] | None = None
    ) -> Window:
        loss, tokens, micro, samples, *rest = saved or [0.0, 0.0, 0, 0, 0.0]
        terms = rest[0] if rest else micro  # saved before summed losses: one per micro-batch
        values = list(rest[1:]) or [0.0] * len(names)
        sums = torch.tensor([loss, tokens, terms], dtype=torch.float, device=where)
        stats = {
            name: torch.tensor(value, dtype=torch.float, device=where)
            for name, value in zip(names, values, strict=True)
        }
        return cls(sums, int(micro), int(samples), stats)

    def add_stats(self, stats: Mapping[str, torch.Tensor]) -> None:
        for name, value in stats.items():
            self.stats[name] += value.detach().float()

    def add(
        self,
        pieces: list[Mapping[str, torch.Tensor]],
        loss: torch.Tensor,
        terms: torch.Tensor | float,
    ) -> None:
        """One micro-batch (its sub-batches): its loss and how many terms it sums."""
        tokens = sum(real_tokens(piece) for piece in pieces)
        sums = self.loss_and_tokens  # added in place: a Python number travels as a kernel
        sums[0] += loss.detach().float()  # argument, with no host tensor copied to the device
        sums[1] += tokens
        sums[2] += terms
        self.micro_batches += 1
        self.samples += sum(examples(piece) for piece in pieces)

    def totals(self, accelerator: Accelerator) -> tuple[dict[str, float], float, float]:
        """Summed over all processes: the mean loss over the window's terms and the task's
        stats as logged (``train/loss``, ``train/<stat>``), the real tokens and the samples."""
        samples = torch.tensor(
            [self.samples], dtype=torch.float, device=self.loss_and_tokens.device
        )
        stats = [value.reshape(1) for value in self.stats.values()]
        totals = accelerator.reduce(
            torch.cat([self.loss_and_tokens, samples, *stats]), reduction="sum"
        )
        loss, tokens, terms, samples, *stat_sums = totals.tolist()
        means = {
            "train/loss": loss / max(terms, 1.0),
            **{
                f"train/{name}": value / max(terms, 1.0)
                for name, value in zip(self.stats, stat_sums, strict=True)
            },
        }
        return means, tokens, samples

    def as_list(self) -> list[float]:
        loss, tokens, terms = self.loss_and_tokens.tolist()
        stats = [float(value) for value in self.stats.values()]
        return [loss, tokens, self.micro_batches, self.samples, terms, *stats]


def examples(batch: Mapping[str, torch.Tensor]) -> int:
    """The examples a batch holds: its rows, or the examples it names (``index``: a preference
    batch, whose rows may be both sides of each pair, or all of them in one padding-free row)."""
    index = batch.get("index")
    return len(index) if index is not None else batch["input_ids"].shape[0]


def real_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | int:
    mask = batch.get("attention_mask")
    return mask.sum() if mask is not None else batch["input_ids"].numel()
