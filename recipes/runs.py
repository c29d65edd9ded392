"""Where a run lives and how it continues: the run folder (a new one, or the one a checkpoint is
resumed in), the settings a resumed run must share with the checkpoint, and putting the run back
at the checkpoint's position."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from omegaconf import DictConfig, OmegaConf

from recipes import checkpoint
from recipes.config import ConfigError, Settings
from recipes.log import get_logger

log = get_logger(__name__)


def open_run_folder(cfg: DictConfig, accelerator: Accelerator) -> tuple[Path, Path | None]:
    """The run folder all ranks share and the checkpoint to continue from (if any).

    Rank 0 looks and every rank learns the verdict, so that all of them stop together.
    """
    output_dir = _agree_on_output_dir(str(cfg.output_dir))
    verdict: tuple[str, str | None] | None = None
    if accelerator.is_main_process:
        try:
            found = check_run_folder(output_dir, cfg.get("resume"))
            verdict = ("ok", str(found) if found else None)
        except ConfigError as err:
            verdict = ("error", str(err))
    kind, value = broadcast_object_list([verdict])[0]
    if kind == "error":
        raise ConfigError(value)
    resume_from = Path(value) if value else None
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        config_file = output_dir / "config.yaml"
        if resume_from is None or not config_file.exists():
            config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()
    return output_dir, resume_from


def check_run_folder(output_dir: Path, resume: str | None) -> Path | None:
    """Refuse a folder whose results would be overwritten; find the checkpoint to resume."""
    found = checkpoint.resolve(resume, output_dir)
    if (output_dir / "final").exists():
        raise ConfigError(
            f"output_dir={output_dir} already holds a finished run (final/); nothing was changed. "
            "Pick a new folder with output_dir=... (or remove that one)."
        )
    marker = next(
        (m for m in ("metrics.jsonl", "checkpoints", "results.json") if (output_dir / m).exists()),
        None,
    )
    if marker is None or resume == "auto":
        return found
    if resume is None:
        raise ConfigError(
            f"output_dir={output_dir} already holds a run ({marker}); nothing was changed. "
            "Continue it with resume=auto, or pick a new folder with output_dir=..."
        )
    assert found is not None
    latest = checkpoint.finished_checkpoints(checkpoint.checkpoints_dir(output_dir))
    if (
        latest
        and found.resolve() != latest[-1].resolve()
        and output_dir.resolve() in found.resolve().parents
    ):
        raise ConfigError(
            f"resume={resume}: output_dir={output_dir} has newer checkpoints ({latest[-1].name}); "
            "continuing an older one there would mix two runs. Continue it in a new folder "
            "(output_dir=...), or resume the latest with resume=auto."
        )
    if output_dir.resolve() not in found.resolve().parents:
        raise ConfigError(
            f"output_dir={output_dir} holds another run ({marker}); resuming {found} there would "
            "mix the two. Pick a new folder with output_dir=..., or continue that run with "
            f"output_dir={found.parent.parent} resume=auto."
        )
    return found


def _agree_on_output_dir(proposed: str) -> Path:
    """All ranks take rank 0's run folder (each rank's Hydra resolved its own timestamp)."""
    chosen = broadcast_object_list([proposed])[0]
    own = Path(proposed)
    if chosen != proposed and own.is_dir() and not any(own.iterdir()):
        own.rmdir()  # the empty folder Hydra made for this rank's own timestamp
    return Path(chosen)


def resume_invariants(
    settings: Settings, global_batch: int, train_features: int, grouped: bool
) -> dict[str, Any]:
    """Settings that decide which batches the steps see: a resumed run must share them.
    ``grouped``: whether batches are length-grouped (``trainer.group_by_length`` with dynamic
    padding on data whose lengths differ; packed blocks are shuffled either way)."""
    data = {
        k: v
        for k, v in vars(settings.data).items()
        if k not in ("cache_dir", "preprocessing_num_workers", "max_eval_examples")
        and not k.startswith("eval_")
    }
    return {
        "global_batch": global_batch,
        "train_features": train_features,
        "trainer.seed": settings.trainer.seed,
        # The batches' order; this sampler's order differs from the transformers one that
        # earlier releases used under the same setting, so a grouped checkpoint says which.
        "trainer.group_by_length": _batch_order(settings.trainer.length_group_size)
        if grouped
        else False,
        "model.name_or_path": settings.model.name_or_path,
        "data": data,
        "peft": dataclasses.asdict(settings.peft),
    }


def _batch_order(group_size: int) -> str:
    # Groups of 50 were the only size before trainer.length_group_size: their checkpoints say so.
    if group_size == 50:
        return "length-grouped, batches shuffled"
    return f"length-grouped by {group_size} batches, batches shuffled"


def resume(
    accelerator: Accelerator, path: Path, fresh: checkpoint.TrainerState, scheduler: Any
) -> checkpoint.TrainerState:
    saved = checkpoint.read_state(path)
    changed = checkpoint.check_compatible(saved, fresh.guarded, fresh.config)
    if changed:
        log.warning("resuming with changed settings: %s", ", ".join(changed))
    state = checkpoint.load(accelerator, path)
    if len(state.window) != accelerator.num_processes:  # a new process count, same global batch
        # accelerate ticks the schedule once per process and step (see build_scheduler).
        ticks = getattr(scheduler, "scheduler", scheduler).last_epoch
        _set_schedule_position(
            scheduler, ticks // max(len(state.window), 1) * accelerator.num_processes
        )
        totals = (
            [sum(column) for column in zip(*state.window, strict=True)] if state.window else None
        )
        state.window = [totals or [0.0, 0.0, 0, 0]] + [[0.0, 0.0, 0, 0]] * (
            accelerator.num_processes - 1
        )
    state.guarded, state.config = fresh.guarded, fresh.config
    log.info(
        "resumed from %s: step %d, epoch %d, %d steps into the epoch",
        path,
        state.step,
        state.epoch,
        state.steps_in_epoch,
    )
    return state


def _set_schedule_position(scheduler: Any, ticks: int) -> None:
    """Move a ``LambdaLR`` schedule (every transformers schedule) to ``ticks`` and set the
    optimizer's learning rates accordingly."""
    inner = getattr(scheduler, "scheduler", scheduler)
    inner.last_epoch = ticks
    inner._last_lr = [
        base * factor(ticks) for base, factor in zip(inner.base_lrs, inner.lr_lambdas, strict=True)
    ]
    for group, lr in zip(inner.optimizer.param_groups, inner._last_lr, strict=True):
        group["lr"] = lr
