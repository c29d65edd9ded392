"""Our side of a throughput comparison, in a process of its own: ``train.py`` run in this process,
then its peak memory written next to its metrics (``benchmark.json``). ``scripts/throughput.py``
(``_ours``) and ``scripts/llm_peers.py`` (``throughput.py sft`` / ``grpo``) both run it, and
their peers record peak memory the same way."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def peak_memory_mb(device: Any) -> float:
    """The device's peak allocated memory, or this process's peak resident set on a CPU."""
    from recipes import device as device_lib

    peak = device_lib.max_memory_allocated(device)
    if peak is not None:
        return peak / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def device_name() -> str:
    from accelerate import PartialState

    return str(PartialState().device)


def run_train(overrides: list[str]) -> None:
    """Run train.py in this process, then record its peak memory next to its metrics."""
    import runpy

    import torch

    sys.argv = [str(ROOT / "train.py"), *overrides]
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            raise
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")))
    device = torch.device(device_name())
    (run_dir / "benchmark.json").write_text(json.dumps({"peak_memory_mb": peak_memory_mb(device)}))
