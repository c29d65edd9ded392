"""A Hydra callback that ``scripts/gpu_check.py`` adds to the train.py processes it starts.

    python train.py -m ... +hydra.callbacks.gpu_check._target_=scripts.gpu_check_hydra.JobRecorder

Several rows of the GPU check share one process (a Hydra multirun: one job per row) to save
start-up time. Hydra raises a failed job's exception only when the whole sweep has run, so this
callback writes each job's outcome into the job's own folder as soon as it ends, where the
check reads it while the process runs on:

- ``gpu_check_job.json`` at the job's start: when it started, and how much device memory was
  still allocated then (what earlier jobs of the process left; after ``gc.collect()``), so a
  peak-memory figure of a later job can be read honestly;
- ``job_error.txt`` when the job raised: the whole traceback (the check quotes its last line).

It only writes files; train.py runs as it always does.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from scripts.gpu_check import atomic_write

JOB_FILE = "gpu_check_job.json"
ERROR_FILE = "job_error.txt"


def _job_dir() -> Path:
    return Path(str(HydraConfig.get().runtime.output_dir))


def _allocated_after_collect() -> int | None:
    """Device bytes still allocated (after a garbage collection); None before torch is loaded
    (the first job of a process) or on CPU."""
    if "torch" not in sys.modules:
        return None
    gc.collect()
    from recipes import device

    module = device.device_module()
    if module is None:
        return None
    empty = getattr(module, "empty_cache", None)
    if empty is not None:
        empty()
    return int(module.memory_allocated())


class JobRecorder(Callback):
    """Writes ``gpu_check_job.json`` when a job starts and ``job_error.txt`` when it fails."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        record = {"started": time.time(), "allocated_at_start": _allocated_after_collect()}
        atomic_write(_job_dir() / JOB_FILE, (json.dumps(record) + "\n").encode())

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if job_return.status != JobStatus.FAILED:
            return
        error = getattr(job_return, "_return_value", None)
        if isinstance(error, BaseException):
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        else:
            text = f"the job failed: {error!r}\n"
        atomic_write(_job_dir() / ERROR_FILE, text.encode())
