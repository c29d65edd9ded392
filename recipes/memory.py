"""A run's memory: its plan (:mod:`recipes.plan`) checked before the model loads, logged next to
the measured peak at the end, the activation offload setting, and an out-of-memory turned into
one line of advice."""

from __future__ import annotations

import os
import resource
from contextlib import AbstractContextManager, nullcontext

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from recipes import device
from recipes import plan as planning
from recipes.config import ConfigError, Settings
from recipes.errors import TrainingError
from recipes.log import get_logger
from recipes.losses import linear_ce

log = get_logger(__name__)


def _shard_size(accelerator: Accelerator) -> int:
    """Processes one copy of the model is sharded over: FSDP all of them, HSDP a node's."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return 1
    parallel = getattr(accelerator, "parallelism_config", None)
    if parallel is not None and parallel.dp_shard_size > 1:
        return int(parallel.dp_shard_size)
    return accelerator.num_processes


def card_bytes(accelerator: Accelerator) -> tuple[str | None, int | None]:
    """(card name, memory in bytes) of this process's device; on a CPU, the machine's RAM."""
    dev = accelerator.device
    if dev.type == "cpu":
        return "this machine's RAM", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module = device.device_module(dev.type)
    properties = getattr(module, "get_device_properties", None)
    if properties is None:
        return None, None
    index = dev.index if dev.index is not None else module.current_device()
    found = properties(index)
    name = planning.card_of_device_name(getattr(found, "name", None)) or getattr(
        found, "name", None
    )
    return name, int(found.total_memory)


def run_plan(
    settings: Settings, accelerator: Accelerator, model: torch.nn.Module | None = None
) -> planning.Plan | None:
    """This run's plan on its own device; None for a task the plan does not size (encoders,
    sequence to sequence, reward models) or a model whose shape is unknown offline. ``model``:
    the loaded model, whose chat loss was decided fused or not (recipes.losses.linear_ce)."""
    if getattr(type(settings.task), "NAME", "") not in planning.PLANNED_TASKS:
        return None
    fsdp_offload = settings.trainer.fsdp_offload
    if fsdp_offload is None:
        fsdp_offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() in ("1", "true")
    name, memory = card_bytes(accelerator)
    try:
        found = planning.plan_settings(
            settings,
            card=name,
            card_bytes=memory,
            processes=accelerator.num_processes,
            shard=_shard_size(accelerator),
            fsdp=accelerator.distributed_type == DistributedType.FSDP,
            fused_loss=None if model is None else linear_ce.enabled(model),
            on_cpu=accelerator.device.type == "cpu",
            mixed_precision=accelerator.mixed_precision,
            labelled=labelled_fraction(settings),
            fsdp_offload=bool(fsdp_offload),
            moore_threads=accelerator.device.type == device.MUSA,
        )
    except planning.PlanError as err:
        log.info("memory plan: none (%s)", err)
        return None
    return found


def labelled_fraction(settings: Settings) -> float | None:
    """1 when every position carries loss (SFT with task.train_on_prompt=true, causal LM
    blocks); else None: the plan's bound."""
    return 1.0 if getattr(settings.task, "train_on_prompt", False) else None


def check_fits(settings: Settings, accelerator: Accelerator) -> planning.Plan | None:
    """Refuse (:class:`ConfigError`, one line) a run whose plan exceeds its card's memory.

    On a CPU only a run larger than the machine's whole RAM is refused: a CPU's peak resident
    memory is the plan's estimate plus whatever the OS and other processes need, which nothing
    here can see, so a nearer margin would refuse runs that fit; the plan is logged either way.
    """
    found = run_plan(settings, accelerator)
    if found is None:
        return None
    if not settings.trainer.check_memory or found.fits is not False:
        return found
    fix = planning.cheapest_fix(found.model, found.run, found.card_bytes)
    raise ConfigError(planning.refusal(found, fix))


def measured_peak(accelerator: Accelerator) -> tuple[int, str]:
    """The run's peak so far: the device allocator's (``max_memory_allocated``), or on a CPU
    this process's peak resident memory (``ru_maxrss``, KiB on Linux)."""
    peak = device.max_memory_allocated(accelerator.device)
    if peak is not None:
        return peak, "max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"


def plan_and_peak(found: planning.Plan | None, accelerator: Accelerator) -> dict[str, float]:
    """The end-of-run line (plan next to the measured peak) and its metrics."""
    peak, how = measured_peak(accelerator)
    metrics = {"memory/peak_gib": peak / planning.GIB}
    if found is None:
        log.info("memory: measured peak %s (%s); no plan", planning.gib(peak), how)
        return metrics
    metrics["memory/plan_gib"] = found.peak_bytes / planning.GIB
    log.info(
        "memory: planned %s (%s), measured %s (%s, this process): %+.0f%%",
        planning.gib(found.peak_bytes),
        found.peak.name,
        planning.gib(peak),
        how,
        100 * (found.peak_bytes - peak) / max(peak, 1),
    )
    return metrics


def activation_offload(enabled: bool, accelerator: Accelerator) -> AbstractContextManager:
    """``trainer.activation_offload``: the tensors autograd saves go to host memory (pinned on
    an accelerator) until backward reads them back."""
    if not enabled:
        return nullcontext()
    pin = accelerator.device.type != "cpu"
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the device (or the host) running out of memory: torch's
    ``OutOfMemoryError`` (torch >= 2.5; the device modules' before), or a backend's
    RuntimeError saying so."""
    kinds = tuple(
        k
        for k in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(device.device_module(), "OutOfMemoryError", None),
        )
        if isinstance(k, type)
    )
    if kinds and isinstance(err, kinds):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def out_of_memory_error(
    err: BaseException, step: int, found: planning.Plan | None, checkpoint: str | None
) -> TrainingError:
    """The one line an out-of-memory ends the run with: where, the plan and the cheapest fix."""
    where = f"out of memory at step {step + 1}"
    if found is not None and found.card_bytes:
        # The plan said it fits (or the check was off): ask for a fifth less than either.
        target = int(min(found.card_bytes, found.needed_bytes) * 0.8)
        fix = planning.cheapest_fix(found.model, found.run, target)
        advice = (
            f"the plan estimated {planning.gib(found.needed_bytes)} of "
            f"{planning.gib(found.card_bytes)}; cheapest fix for a fifth less: "
            f"{fix or 'none of those tried'}"
        )
    else:
        advice = "try trainer.gradient_checkpointing=true, peft=lora or a smaller micro-batch"
    kept = f"last checkpoint {checkpoint} is intact" if checkpoint else "no checkpoint was saved"
    return TrainingError(f"{where}: {advice}; {kept} (resume=auto continues from it)")


def set_fsdp_offload(setting: bool | None) -> None:
    """``trainer.fsdp_offload``: accelerate's FSDP plugin reads ``FSDP_OFFLOAD_PARAMS`` (the
    config's ``fsdp_offload_params``, set by ``accelerate launch``) when it is built; null
    leaves the launch's own. Refused outside an FSDP launch, where nothing is sharded."""
    if setting is None:
        return
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() not in ("1", "true"):
        if setting:
            raise ConfigError(
                "trainer.fsdp_offload=true: the run is not launched with FSDP; launch with "
                "accelerate launch --config_file conf/accelerate/fsdp2.yaml, or drop the setting."
            )
        return
    os.environ["FSDP_OFFLOAD_PARAMS"] = "true" if setting else "false"
