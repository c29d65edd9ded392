"""A stop request (SIGTERM, Ctrl-C) agreed by every process: :class:`StopPoll` asks all of them
on the host, :class:`StopPolled` before each batch of an evaluation."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader

from recipes.faults import StopNow, StopRequest


class StopPolled:
    """An evaluation loader that raises :class:`StopNow` on every process before the next batch
    once any process was asked to stop (one small all-reduce per batch; every process takes the
    same number of evaluation batches). Anything else is the loader's own."""

    def __init__(self, loader: DataLoader, poll: StopPoll) -> None:
        self.loader, self.poll = loader, poll

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.poll.asked():
                raise StopNow()
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class StopPoll:
    """Whether any process was asked to stop (SIGTERM, Ctrl-C), asked on the host: one small
    all-reduce of a CPU tensor over gloo (the process group itself where it is gloo, else a gloo
    group beside NCCL / MCCL), so that polling at every step never waits for the device's
    queue. Every process must call :meth:`asked` together."""

    def __init__(self, accelerator: Accelerator, stop: StopRequest, timeout_s: int) -> None:
        self.stop = stop
        self.several = accelerator.num_processes > 1
        self.group = None
        if self.several and dist.get_backend() != dist.Backend.GLOO:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def raise_if_asked(self) -> None:
        """Raise :class:`StopNow` on every process if any was asked to stop (one all-reduce),
        once the run's handler is installed."""
        if self.stop.installed and self.asked():
            raise StopNow()

    def polled(self, loader: DataLoader) -> Any:
        """``loader``, asking all processes before each batch whether one of them was asked to
        stop (several processes; one stops at once without asking)."""
        if not self.stop.installed or not self.several:
            return loader
        return StopPolled(loader, self)

    def asked(self) -> bool:
        asked = self.stop.signum is not None
        if not self.several:
            return asked
        flag = torch.tensor([float(asked)])
        dist.all_reduce(flag, group=self.group)
        return bool(flag[0] > 0)
