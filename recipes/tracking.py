"""One metrics path: every number goes to ``metrics.jsonl`` and to the configured trackers."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from recipes.config import LoggerConfig
from recipes.log import get_logger

log = get_logger(__name__)


def wandb_mode(requested: str) -> str:
    """Resolve ``logger.wandb.mode=auto``: online when the machine is logged in, else offline.

    An explicit ``WANDB_MODE`` in the environment wins, as it does for every wandb user.
    """
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


def tracker_init_kwargs(cfg: LoggerConfig, run_name: str, output_dir: Path) -> dict[str, Any]:
    """Keyword arguments for ``Accelerator.init_trackers`` per tracker."""
    kwargs: dict[str, Any] = {}
    if "wandb" in cfg.trackers:
        kwargs["wandb"] = {
            "name": run_name,
            "dir": str(output_dir),
            "mode": wandb_mode(cfg.wandb.mode),
            "tags": list(cfg.wandb.tags),
            "group": cfg.wandb.group,
            "entity": cfg.wandb.entity,
        }
    return kwargs


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl record; None for a line torn by a crash."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLogger:
    """Fans a dict of numbers out to ``metrics.jsonl`` and ``accelerator.log`` (main process)."""

    def __init__(
        self, accelerator: Accelerator, output_dir: Path, keep_until_step: int | None = None
    ) -> None:
        """``keep_until_step``: a resumed run drops the records its checkpoint's step had not
        reached (logged before the interruption, to be logged again), so the file reads as one
        uninterrupted run."""
        self.accelerator = accelerator
        self._file = None
        if accelerator.is_main_process:
            path = output_dir / "metrics.jsonl"
            if keep_until_step is not None and path.exists():
                kept = [
                    line
                    for line in path.read_text().splitlines(keepends=True)
                    if _step_of(line) is not None and _step_of(line) <= keep_until_step
                ]
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(kept))
                tmp.replace(path)
            self._file = path.open("a", buffering=1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step`` (a no-op on non-main processes)."""
        if not self.accelerator.is_main_process:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()
        }
        assert self._file is not None
        self._file.write(json.dumps({"step": step, "time": round(time.time(), 3), **clean}) + "\n")
        self.accelerator.log(metrics, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
