"""Checkpoints that a run continues from exactly, written so that a kill never leaves a broken one.

``<output_dir>/checkpoints/step-00000120/`` holds

* what ``accelerator.save_state`` writes: model, optimizer, scheduler, gradient scaler and every
  process's RNG states (FSDP: each rank's shards);
* the model's ``config.json`` and the tokenizer, so ``from_pretrained`` loads the folder;
* ``trainer_state.json``, written last: step, data position, the running log window, the best
  evaluation so far and the settings a resumed run must share.

A checkpoint is written into a hidden ``.tmp-step-…`` folder and renamed once every process has
finished: only complete checkpoints carry a ``step-`` name, whatever moment a kill strikes. The
run folder must be on a file system every node sees (as for any multi-node checkpoint).

Exact continuation also needs randomness that follows the run's position: see
:mod:`recipes.seeding`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from recipes.config import ConfigError
from recipes.log import get_logger

log = get_logger(__name__)

STATE_FILE = "trainer_state.json"
PREFIX = "step-"
BEST_FILE = "best.json"


@dataclass
class TrainerState:
    """Where a run is; saved with every checkpoint."""

    step: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0  # optimizer steps done in ``epoch`` (the data position)
    batches_in_epoch: int = 0  # micro-batches each process has taken from ``epoch``
    last_eval_step: int = -1
    train_seconds: float = 0.0
    train_samples: float = 0.0
    skipped_steps: int = 0  # updates dropped for a non-finite loss (trainer.on_nonfinite=skip)
    best: dict[str, Any] | None = None  # {"metric", "value", "step"}
    evals_since_best: int = 0  # evaluations since the last new best (early stopping)
    # Per process: [loss sum, tokens, micro-batches, samples] since the last log step.
    window: list[list[float]] = field(default_factory=list)
    guarded: dict[str, Any] = field(default_factory=dict)  # what a resumed run must not change
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config of the run


def name_of(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"{PREFIX}{step:08d}"


def checkpoints_dir(output_dir: Path) -> Path:
    """Where a run folder keeps its checkpoints."""
    return output_dir / "checkpoints"


def finished_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints under ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def resolve(resume: str | None, output_dir: Path) -> Path | None:
    """The checkpoint ``resume`` names: ``auto`` (the latest in ``output_dir``, or None when
    there is none), a checkpoint folder, or a run folder (its latest checkpoint)."""
    if resume is None:
        return None
    if resume == "auto":
        found = finished_checkpoints(checkpoints_dir(output_dir))
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if (path / STATE_FILE).is_file():
        return path
    for folder in (checkpoints_dir(path), path):
        found = finished_checkpoints(folder)
        if found:
            return found[-1]
    if path.name.startswith(".tmp-"):
        why = "it is an unfinished checkpoint (the write was interrupted)"
    elif path.exists():
        why = "it holds no complete checkpoint"
    else:
        why = "no such folder"
    raise ConfigError(
        f"resume={resume}: {why}. Give a checkpoint folder (<run>/checkpoints/step-N), a run "
        "folder, or resume=auto with output_dir=<run folder>."
    )


def save(
    accelerator: Accelerator,
    output_dir: Path,
    state: TrainerState,
    model: torch.nn.Module,
    tokenizer: Any,
) -> Path:
    """Write the checkpoint of ``state.step`` atomically; every process must call this."""
    folder = checkpoints_dir(output_dir)
    final = folder / name_of(state.step)
    tmp = folder / f".tmp-{final.name}"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_loadable_files(tmp, accelerator.unwrap_model(model), tokenizer, state)
        _fsync_tree(tmp)
        if final.exists():  # the same step saved again (an evaluation's best after a save)
            _delete(final)
        os.replace(tmp, final)
        _fsync(folder)
    accelerator.wait_for_everyone()
    return final


def _write_loadable_files(
    folder: Path, model: torch.nn.Module, tokenizer: Any, state: TrainerState
) -> None:
    """What makes ``folder`` load with ``from_pretrained`` and resume: the model's config, the
    tokenizer, and last the trainer state (its presence marks the write as complete)."""
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / STATE_FILE).write_text(json.dumps(asdict(state), indent=1, default=str))


def read_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / STATE_FILE).read_text()))


def load(accelerator: Accelerator, path: Path) -> TrainerState:
    """Restore model, optimizer, scheduler and RNG from ``path``; returns its trainer state."""
    try:
        accelerator.load_state(str(path))
    except KeyError as err:
        # accelerate < 1.x reads its micro-batch counter from this process's RNG file, which a
        # checkpoint of fewer processes lacks (model, optimizer and scheduler are loaded by
        # then; the loop sets the counter itself and seeds by position).
        if err.args != ("step",):
            raise
    return read_state(path)


def mark_best(output_dir: Path, state: TrainerState) -> None:
    """Record which checkpoint is the best so far (``checkpoints/best.json``)."""
    assert state.best is not None
    best = {**state.best, "path": name_of(state.best["step"])}
    tmp = checkpoints_dir(output_dir) / f".{BEST_FILE}.tmp"
    tmp.write_text(json.dumps(best, indent=1))
    os.replace(tmp, checkpoints_dir(output_dir) / BEST_FILE)


def rotate(output_dir: Path, keep: int | None, best_step: int | None) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (never the best one), and the
    leftovers of interrupted writes."""
    folder = checkpoints_dir(output_dir)
    for stale in [*folder.glob(".tmp-*"), *folder.glob(".del-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    if keep is None:
        return
    found = finished_checkpoints(folder)
    for old in found[: max(len(found) - keep, 0)]:
        if best_step is None or old.name != name_of(best_step):
            _delete(old)


def _delete(checkpoint: Path) -> None:
    """Remove a checkpoint so that no moment of it looks complete: first away from its name
    (one atomic rename), then file by file."""
    doomed = checkpoint.with_name(f".del-{checkpoint.name}")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed)


def check_compatible(saved: TrainerState, guarded: dict[str, Any], config: dict) -> list[str]:
    """Refuse to continue a checkpoint under settings that change what the steps mean; return
    the other changed settings (to be warned about)."""
    changed = [k for k in guarded if k in saved.guarded and saved.guarded[k] != guarded[k]]
    if changed:
        detail = "; ".join(f"{k}: {saved.guarded[k]} then, {guarded[k]} now" for k in changed)
        raise ConfigError(
            f"resume: the checkpoint was trained with different settings ({detail}). Resuming "
            "would continue on different batches. Restore those settings, or start a new run "
            "(drop resume=..., choose a new output_dir)."
        )
    old, new = _flatten(saved.config), _flatten(config)
    ignore = ("output_dir", "resume")
    return sorted(
        k
        for k in set(old) | set(new)
        if old.get(k) != new.get(k) and not k.startswith(ignore) and k in old
    )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in flat.items()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush the checkpoint to disk before it gets its name (a crash of the machine, not only of
    the process, must not leave a named checkpoint with missing bytes)."""
    for path in folder.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(folder)
