"""Where a run lives and how it continues: the run folder (a new one, or the one a checkpoint is
resumed in), held by one run at a time, the settings a resumed run must share with the
checkpoint, and putting the run back at the checkpoint's position."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from omegaconf import OmegaConf

from recipes import checkpoint
from recipes.config import ConfigError, Settings
from recipes.log import get_logger

log = get_logger(__name__)


LOCK_FILE = ".lock"
_held: dict[Path, int] = {}  # run folders this process holds: their lock file's descriptor


def open_run_folder(settings: Settings, accelerator: Accelerator) -> tuple[Path, Path | None]:
    """The run folder all ranks share and the checkpoint to continue from (if any).

    Rank 0 takes the folder's lock (:func:`hold`), looks, and every rank learns the verdict, so
    that all of them stop together; a refused run changes nothing in the folder.
    """
    output_dir = _agree_on_output_dir(settings.output_dir)
    verdict: tuple[str, str | None] | None = None
    if accelerator.is_main_process:
        try:
            hold(output_dir)
            if settings.resume == "auto":  # the run continues in place: tidy it first
                for done in checkpoint.remove_leftovers(output_dir):
                    log.info("%s: %s", output_dir, done)
            found = check_run_folder(output_dir, settings.resume)
            config_file = output_dir / "config.yaml"
            if found is None or not config_file.exists():
                config_file.write_text(OmegaConf.to_yaml(settings.resolved))
            verdict = ("ok", str(found) if found else None)
        except ConfigError as err:
            release(output_dir)
            verdict = ("error", str(err))
        except OSError as err:  # a full disk, a read-only or foreign folder: said, not raised
            release(output_dir)
            full = (
                "no space left on device" if checkpoint.disk_full(err) else err.strerror or "error"
            )
            verdict = ("error", f"output_dir={output_dir}: {full} ({err}).")
    kind, value = broadcast_object_list([verdict])[0]
    if kind == "error":
        raise ConfigError(value)
    return output_dir, Path(value) if value else None


def hold(output_dir: Path) -> None:
    """Take ``output_dir``'s lock (``.lock``, an fcntl lock: on NFS it holds across nodes where
    the server has locking) until :func:`release`, which removes the file, or the process ends;
    the kernel drops the lock of a process that died, so a lock whose owner is gone is taken
    over. A second run gets a ConfigError naming the owner. Where the file system has no locks,
    a warning says that two runs in one folder are not prevented."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):
                raise ConfigError(
                    f"output_dir={output_dir} is in use by another run ({_owner(path)}); nothing "
                    "was changed. Wait for it to end, or pick another folder with output_dir=..."
                ) from None
            path.unlink(missing_ok=True)
            log.warning(
                "output_dir=%s: this file system takes no locks (%s); nothing stops a second "
                "run from writing to the same folder",
                output_dir,
                err.strerror,
            )
            return
        if _same_file(fd, path):
            break
        os.close(fd)  # its owner released and removed it as we opened it: take the new one
    os.ftruncate(fd, 0)
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%F %T")}
    os.write(fd, json.dumps(owner).encode())
    _held[output_dir] = fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def release(output_dir: Path) -> None:
    """Give up the lock :func:`hold` took and remove its file, still holding it (so that no
    other run locks the removed file); a no-op when this process holds none."""
    fd = _held.pop(output_dir, None)
    if fd is not None:
        (output_dir / LOCK_FILE).unlink(missing_ok=True)
        os.close(fd)


def release_all() -> None:
    for output_dir in list(_held):
        release(output_dir)


def _owner(path: Path) -> str:
    try:
        owner = json.loads(path.read_text() or "{}")
        return f"pid {owner['pid']} on {owner['host']}, since {owner['since']}"
    except (OSError, ValueError, KeyError):
        return "its owner did not say who it is"


def check_run_folder(output_dir: Path, resume: str | None) -> Path | None:
    """Refuse a folder whose results would be overwritten; find the checkpoint to resume."""
    found = checkpoint.resolve(resume, output_dir)
    final = output_dir / checkpoint.FINAL
    # An earlier release wrote final/ in place: a kill during that save left it without weights,
    # beside the checkpoints the run continues from. Without them it counts as finished.
    interrupted = final.is_dir() and not checkpoint.final_complete(output_dir)
    interrupted = interrupted and bool(
        checkpoint.finished_checkpoints(checkpoint.checkpoints_dir(output_dir))
    )
    if final.exists() and not interrupted:
        raise ConfigError(
            f"output_dir={output_dir} already holds a finished run (final/); nothing was changed. "
            "Pick a new folder with output_dir=... (or remove that one)."
        )
    if interrupted:
        if resume != "auto":
            raise ConfigError(
                f"output_dir={output_dir} holds an unfinished run: its final/ is incomplete (no "
                "weights; the save was interrupted). Continue it with resume=auto (the "
                "incomplete final/ is removed), or pick a new folder with output_dir=..."
            )
        checkpoint.discard(final)
        log.warning("removed the incomplete final/ of an interrupted save in %s", output_dir)
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
    inner = getattr(scheduler, "scheduler", scheduler)
    hyper = _hyperparameters(inner)  # this run's, which loading the checkpoint replaces
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
    applied = [k for k in changed if k.startswith(("optimizer.", "scheduler.", "trainer.max_st"))]
    if applied:
        # The checkpoint's optimizer groups and schedule peak (base_lrs) would silently keep the
        # old values: put this run's back and move its schedule to the checkpoint's position.
        _restore_hyperparameters(inner, hyper)
        _set_schedule_position(scheduler, inner.last_epoch)
        old, new = checkpoint.flatten(saved.config), checkpoint.flatten(fresh.config)
        log.warning(
            "resuming with changed settings, applied from step %d on: %s (lr now %.4g)",
            state.step,
            ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in applied),
            inner.get_last_lr()[0],
        )
    if set(changed) - set(applied):
        log.warning(
            "resuming with changed settings: %s", ", ".join(sorted(set(changed) - set(applied)))
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


def _hyperparameters(scheduler: Any) -> tuple[list[float], list[dict[str, Any]]]:
    """The schedule's peak learning rates and the optimizer groups' other settings."""
    groups = [
        {k: v for k, v in group.items() if k not in ("params", "lr", "fused", "foreach")}
        for group in scheduler.optimizer.param_groups
    ]
    return list(scheduler.base_lrs), groups


def _restore_hyperparameters(
    scheduler: Any, hyper: tuple[list[float], list[dict[str, Any]]]
) -> None:
    base_lrs, groups = hyper
    scheduler.base_lrs = list(base_lrs)
    for group, own in zip(scheduler.optimizer.param_groups, groups, strict=True):
        group.update(own)


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
