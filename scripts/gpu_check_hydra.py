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
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

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


# ------------------------------------------------------------------------ the step profiler

PROFILE_FILE = "profile.json"
OPS_FILE = "profile_ops.txt"
PENDING_FILE = "profile.pending"
# Runtime calls counted per step (the names torch's profiler gives CUDA's; MUSA's differ).
ALLOC_CALLS = ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaHostAlloc")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


class StepProfiler(Callback):
    """Times every optimizer step of each job and runs ``torch.profiler`` (CPU and device
    activities, ``record_shapes``) over ``profiled`` steps after ``warmup``; at the job's end
    writes ``profile.json`` (per step: host seconds and the input shapes it saw for the first
    time in this process; over the profiled window: device-busy time against wall time, counts
    per step of allocator calls, host syncs, device-to-host copies and kernel launches, the top
    kernels and operators) and ``profile_ops.txt`` (the profiler's ``key_averages`` tables).

    Added by ``gpu_check.py``'s profile rows as a second callback: nothing in the loop changes.
    It hooks what every training loop has, through torch's global hooks (public since torch
    2.0): the optimizer's step (``register_optimizer_step_post_hook``; one step per batch) and
    the forward of the word embedding (the first ``nn.Embedding`` with at least 1000 rows: its
    input is each sub-batch's ``input_ids``, whose shape is the shape every kernel sees)."""

    # Input shapes seen by this process, across its jobs (the caches of kernels, heuristics and
    # the allocator live as long as the process).
    seen: ClassVar[set[tuple[int, ...]]] = set()

    def __init__(self, warmup: int = 5, profiled: int = 3, top: int = 15) -> None:
        self.warmup, self.profiled, self.top = warmup, profiled, top
        self.job: dict[str, Any] | None = None

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from recipes import device

        self.job = job = {
            "dir": _job_dir(),
            "steps": [],
            "shapes": [],  # this step's input shapes so far
            "resumed": time.perf_counter(),
            "prof": None,
            "window": None,
            "handles": [],
            "module": device.device_module(),
            "stats0": None,
        }

        def embedding_hook(module: Any, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2:
                job["shapes"].append(tuple(args[0].shape))

        def find_embedding(module: Any, args: tuple) -> None:
            finder = job.pop("finder", None)
            if finder is None or not isinstance(module, torch.nn.Embedding):
                if finder is not None:
                    job["finder"] = finder
                return
            if module.num_embeddings < 1000:  # positions or token types
                job["finder"] = finder
                return
            finder.remove()  # found: one hook on that module from now on
            job["handles"].append(module.register_forward_pre_hook(embedding_hook))
            embedding_hook(module, args)

        def step_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            ended = time.perf_counter()
            shapes = job["shapes"]
            new = [s for s in dict.fromkeys(shapes) if s not in StepProfiler.seen]
            StepProfiler.seen.update(shapes)
            job["steps"].append(
                {"s": ended - job["resumed"], "sub": len(shapes), "new": len(new),
                 "len": max((s[-1] for s in shapes), default=0)}
            )  # fmt: skip
            job["shapes"] = []
            done = len(job["steps"])
            if done == self.warmup and self.profiled > 0:
                self._start_profiler(job)
            elif done == self.warmup + self.profiled and job["prof"] is not None:
                self._stop_profiler(job)
            job["resumed"] = time.perf_counter()

        # train.py writes results.json before this callback's on_job_end: the check waits for
        # profile.json while this file is there.
        atomic_write(job["dir"] / PENDING_FILE, b"")
        job["finder"] = register_module_forward_pre_hook(find_embedding)
        job["handles"].append(register_optimizer_step_post_hook(step_hook))

    def _sync(self, job: dict) -> None:
        module = job["module"]
        if module is not None:
            module.synchronize()

    def _start_profiler(self, job: dict) -> None:
        import torch

        from recipes import device

        activities = [torch.profiler.ProfilerActivity.CPU]
        if job["module"] is not None:  # MUSA's kernels are PrivateUse1 activities
            activities.append(device.profiler_activity())
        self._sync(job)
        if job["module"] is not None:
            job["stats0"] = dict(job["module"].memory_stats())
        job["prof"] = torch.profiler.profile(activities=activities, record_shapes=True)
        job["prof"].start()
        job["window"] = [time.perf_counter(), None]

    def _stop_profiler(self, job: dict) -> None:
        self._sync(job)
        job["window"][1] = time.perf_counter()
        job["prof"].stop()
        if job["module"] is not None:
            after = job["module"].memory_stats()
            job["allocator"] = {
                key: after.get(key, 0) - job["stats0"].get(key, 0)
                for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")
                if key in after
            }

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        job, self.job = self.job, None
        if job is None:
            return
        for handle in [*job["handles"], *filter(None, [job.pop("finder", None)])]:
            handle.remove()
        if job["prof"] is not None and job["window"][1] is None:  # the job ended inside it
            self._stop_profiler(job)
        record: dict[str, Any] = {
            "warmup": self.warmup,
            "profiled": self.profiled,
            "steps": job["steps"],
            "allocator": job.get("allocator"),
        }
        text = ""
        if job["prof"] is not None:
            summary, text = summarise(job["prof"], self.profiled, job["window"], self.top)
            record.update(summary)
        atomic_write(job["dir"] / OPS_FILE, text.encode())
        atomic_write(job["dir"] / PROFILE_FILE, (json.dumps(record) + "\n").encode())
        (job["dir"] / PENDING_FILE).unlink(missing_ok=True)


def summarise(prof: Any, steps: int, window: list[float], top: int) -> tuple[dict, str]:
    """Per-step figures of a profiled window, and its key_averages tables as text."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    device = [e for e in events if e.device_type != DeviceType.CPU]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in device)
    busy, end = 0.0, -math.inf  # the union of the device's intervals (us)
    for start, stop in intervals:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    counts: dict[str, int] = {}
    kernels: dict[str, list[float]] = {}
    for e in events:
        counts[e.name] = counts.get(e.name, 0) + 1
    for e in device:
        slot = kernels.setdefault(e.name, [0.0, 0])
        slot[0] += e.time_range.end - e.time_range.start
        slot[1] += 1

    def per_step(names: tuple[str, ...]) -> float:
        return sum(counts.get(n, 0) for n in names) / steps

    dtoh = sum(n for name, n in counts.items() if name.startswith("Memcpy DtoH"))
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    cpu_ops = sorted(
        (e for e in prof.key_averages() if e.key.startswith("aten::")),
        key=lambda e: -e.self_cpu_time_total,
    )[:top]
    wall = (window[1] - window[0]) / steps
    summary = {
        "wall_s_per_step": wall,
        "device_busy_s_per_step": busy / 1e6 / steps if device else None,
        "per_step": {
            "cudaMalloc": per_step(("cudaMalloc", "cudaMallocAsync")),
            "cudaFree": per_step(("cudaFree", "cudaFreeAsync")),
            "host_syncs": per_step(SYNC_CALLS),
            "memcpy_dtoh": dtoh / steps,
            "cudaMemcpyAsync": per_step(("cudaMemcpyAsync", "cudaMemcpy")),
            "kernel_launches": per_step(LAUNCH_CALLS),
            "device_events": len(device) / steps,
        },
        "top_kernels": [
            {"name": name[:120], "ms_per_step": t / 1e3 / steps, "calls_per_step": n / steps}
            for name, (t, n) in ranked
        ],
        "top_cpu_ops": [
            {
                "name": e.key,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                "calls_per_step": e.count / steps,
            }
            for e in cpu_ops
        ],
        "attention_ops": sorted(
            {e.name for e in events if "attention" in e.name and e.name.startswith("aten::")}
        ),
    }
    tables = []
    for title, averages, key in (
        ("by device time", prof.key_averages(), "device"),
        ("by CPU time", prof.key_averages(), "cpu"),
        ("by input shape, by CPU time", prof.key_averages(group_by_input_shape=True), "cpu"),
    ):
        sort = "self_cpu_time_total"
        if key == "device":  # the attribute's name before torch 2.4: self_cuda_time_total
            new = not averages or hasattr(averages[0], "self_device_time_total")
            sort = "self_device_time_total" if new else "self_cuda_time_total"
        try:
            table = averages.table(sort_by=sort, row_limit=40, max_name_column_width=80)
        except Exception as err:  # a sort key this torch does not know
            table = f"({type(err).__name__}: {err})"
        tables.append(f"== {steps} profiled steps, {title} ==\n{table}\n")
    return summary, "\n".join(tables)
