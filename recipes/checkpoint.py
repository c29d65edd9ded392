"""Checkpoints that a run continues from exactly, written so that a kill never leaves a broken one.

``<output_dir>/checkpoints/step-00000120/`` holds

* what ``accelerator.save_state`` writes: model, optimizer, scheduler, gradient scaler and every
  process's RNG states (FSDP: each rank's shards);
* the model's ``config.json`` and the tokenizer, so ``from_pretrained`` loads the folder;
* ``trainer_state.json``, written last: step, data position, the running log window, the best
  evaluation so far and the settings a resumed run must share.

A checkpoint is written into a hidden ``.tmp-step-…`` folder and renamed once every process has
finished: only complete checkpoints carry a ``step-`` name, whatever moment a kill strikes.
``final/`` is written the same way (``.tmp-final``), so a run folder with a ``final/`` holds a
finished run. A write that fails (a full disk, say) is removed on every process and said in one
line, with the space it needs; every earlier checkpoint stays. The run folder must be on a file
system every node sees (as for any multi-node checkpoint).

Exact continuation also needs randomness that follows the run's position: see
:mod:`recipes.seeding`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object

from recipes.config import ConfigError
from recipes.errors import TrainingError
from recipes.log import get_logger

log = get_logger(__name__)

STATE_FILE = "trainer_state.json"
PREFIX = "step-"
BEST_FILE = "best.json"
FINAL = "final"
RECIPE_FILE = "recipe.json"  # in final/: the run's settings predict needs (write_recipe)
# What interrupted writes leave: in a run folder and in its checkpoints/ folder.
LEFTOVERS = (".tmp-*", ".del-*")


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
    last_scores: dict[str, float] = field(default_factory=dict)  # at last_eval_step (> 0)
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
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write the checkpoint of ``state.step`` atomically; every process must call this."""
    folder = checkpoints_dir(output_dir)
    final = folder / name_of(state.step)
    tmp = folder / f".tmp-{final.name}"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    # The main process's estimate: the last checkpoint's size, or for the first one at least the
    # trained weights and the optimizer's state.
    need = 0
    if accelerator.is_main_process:
        found = finished_checkpoints(folder)
        need = (
            tree_size(found[-1])
            if found
            else _all_shards(accelerator, _state_bytes(model, optimizer))
        )
    check_space(accelerator, folder, need, f"checkpoint {final.name}")

    def publish() -> None:
        _write_loadable_files(tmp, accelerator.unwrap_model(model), tokenizer, state)
        _fsync_tree(tmp)
        old = None
        if final.exists():  # the same step saved again (an evaluation's best after a save)
            old = final.with_name(f".del-{final.name}")
            os.replace(final, old)  # deleted once the new one has the name
        os.replace(tmp, final)
        _fsync(folder)
        if old is not None:
            shutil.rmtree(old)

    write_together(
        accelerator,
        tmp,
        lambda: accelerator.save_state(str(tmp)),
        publish,
        f"checkpoint {final.name}",
        need,
    )
    return final


def save_final(
    accelerator: Accelerator, output_dir: Path, write: Callable[[Path], None], need: int
) -> Path:
    """``final/``, written by ``write(folder)`` (every process calls both) into ``.tmp-final``
    and renamed when complete: a ``final/`` is always whole."""
    final, tmp = output_dir / FINAL, output_dir / f".tmp-{FINAL}"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    check_space(accelerator, output_dir, need, "the final model")

    def publish() -> None:
        for folder in (tmp, tmp / "base"):  # the model, and a LoRA run's base written beside it
            add_legacy_rope(folder)
        _fsync_tree(tmp)
        os.replace(tmp, final)
        _fsync(output_dir)

    write_together(accelerator, tmp, lambda: write(tmp), publish, "the final model", need)
    return final


# What transformers 4.x reads at the top of config.json; transformers 5 writes them only inside
# ``rope_parameters``, and a 4.x reader (vLLM releases built on it, most MUSA images) then takes
# the class's defaults: rope_theta 10000 for SmolLM2's 100000 or Llama 3's 500000, no scaling.
LEGACY_ROPE_FIELDS = ("rope_theta", "partial_rotary_factor")


def add_legacy_rope(folder: Path) -> None:
    """``folder/config.json`` with its ``rope_parameters`` also where transformers 4.x reads
    them (``rope_theta``, ``partial_rotary_factor``, and ``rope_scaling`` for scaled RoPE), so
    a model saved by transformers 5 loads the same in 4.x; transformers 5 reads either. A config
    without them (written by 4.x), or with one per layer type, is left as it is."""
    path = folder / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_type" not in rope:
        return
    legacy = {k: rope[k] for k in LEGACY_ROPE_FIELDS if k in rope}
    if rope["rope_type"] != "default":
        legacy["rope_scaling"] = {k: v for k, v in rope.items() if k not in LEGACY_ROPE_FIELDS}
    if any(config.get(k) != v for k, v in legacy.items()):
        path.write_text(json.dumps({**config, **legacy}, indent=2, sort_keys=True) + "\n")


def write_together(
    accelerator: Accelerator,
    tmp: Path,
    write_all: Callable[[], None],
    publish: Callable[[], None],
    what: str,
    need: int,
) -> None:
    """Every process runs ``write_all`` (into ``tmp``), then the main process ``publish``es it.
    If any process fails, all of them learn it, ``tmp`` is removed and the same one-line
    :class:`TrainingError` is raised everywhere (a full disk says so, with the space needed).
    Under FSDP, ``write_all`` gathers the shards with collectives: a process that fails inside
    it has left the others inside one, which an agreement (one more collective) would never
    meet (a hang on NCCL and MCCL, a mismatch on gloo). That process stops alone, with the same
    line, and the launcher ends the others."""
    own = _attempt(write_all)
    if own is not None and accelerator.distributed_type == DistributedType.FSDP:
        removed = accelerator.is_main_process  # else the next save's clean-up removes it
        if removed:
            shutil.rmtree(tmp, ignore_errors=True)
        raise TrainingError(_write_failure(own, tmp, what, need, removed))
    error = _agreed_failure(accelerator, own)
    if error is None:
        error = _agreed_failure(
            accelerator, _attempt(publish) if accelerator.is_main_process else None
        )
    if error is None:
        return
    written = tree_size(tmp) if accelerator.is_main_process and tmp.exists() else 0
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    raise TrainingError(_write_failure(error, tmp, what, max(need, written)))


def _write_failure(
    error: tuple[str, str], tmp: Path, what: str, need: int, removed: bool = True
) -> str:
    """The one line of a failed write (:func:`_attempt`'s ``error``) into ``tmp``."""
    kind, detail = error
    partial = "the partial write was removed" if removed else f"the partial write {tmp} is left"
    if kind == "disk full":
        return _no_space(tmp.parent, what, need, f"{partial} ({detail})")
    return (
        f"could not write {what} to {tmp.parent} ({detail}); {partial} and every earlier "
        "checkpoint is kept."
    )


def _attempt(write: Callable[[], None]) -> tuple[str, str] | None:
    """None, or what went wrong: ("disk full" | "error", the first line of the error)."""
    try:
        write()
    except Exception as err:  # reported on every process by write_together
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        return ("disk full" if disk_full(err) else "error", f"{type(err).__name__}: {first}")
    return None


def _agreed_failure(
    accelerator: Accelerator, own: tuple[str, str] | None
) -> tuple[str, str] | None:
    """The first process's failure, known to every process (None when all succeeded)."""
    if accelerator.num_processes == 1:
        return own
    found = [failure for failure in gather_object([own]) if failure is not None]
    return found[0] if found else None


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a full disk or quota: an OSError's errno, or the
    words torch's zip writer ("unexpected pos"), safetensors and the OS use."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if any(m in text for m in ("No space left", "StorageFull", "quota", "unexpected pos")):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_space(accelerator: Accelerator, folder: Path, need: int, what: str) -> None:
    """Refuse to start a write of about ``need`` bytes (the main process's estimate) into
    ``folder`` when its file system has less free space; every process learns the verdict."""
    verdict = None
    if accelerator.is_main_process and need > 0:
        free = shutil.disk_usage(_existing(folder)).free
        if free < need:
            verdict = _no_space(folder, what, need, "nothing was written")
    if accelerator.num_processes > 1:
        verdict = broadcast_object_list([verdict])[0]
    if verdict:
        raise TrainingError(verdict)


def _no_space(folder: Path, what: str, need: int, done: str) -> str:
    free = shutil.disk_usage(_existing(folder)).free
    kept = finished_checkpoints(folder if folder.name == "checkpoints" else folder / "checkpoints")
    latest = f"latest: {kept[-1].name}" if kept else "none was saved yet"
    return (
        f"no space left on device: {what} needs about {_size(need)} in {folder} and "
        f"{_size(free)} is free; {done}, and every earlier checkpoint is kept ({latest}). "
        "Free space (or lower trainer.keep_last_n_checkpoints, or move output_dir), then "
        "continue with the same command plus resume=auto."
    )


def _size(size: int) -> str:
    return f"{size / 1024**3:.1f} GiB" if size >= 1024**3 else f"{size / 1024**2:.1f} MiB"


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def tree_size(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """At least what a first checkpoint writes from this process: the trained weights and the
    optimizer's state."""
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    moments = 0
    if optimizer is not None:
        for values in optimizer.state.values():
            moments += sum(
                v.numel() * v.element_size()
                for v in values.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )
    return trained + moments


def weights_bytes(accelerator: Accelerator, model: torch.nn.Module) -> int:
    """About what ``final/`` writes: the model's weights (gathered whole under FSDP)."""
    return _all_shards(accelerator, sum(p.numel() * p.element_size() for p in model.parameters()))


def _all_shards(accelerator: Accelerator, size: int) -> int:
    """``size``, this process's bytes, over all processes' shards under FSDP (elsewhere each
    process holds the whole)."""
    sharded = accelerator.distributed_type == DistributedType.FSDP
    return size * (accelerator.num_processes if sharded else 1)


def write_recipe(folder: Path, recipe: dict[str, Any]) -> None:
    """``folder/recipe.json``: the settings of the run that wrote this ``final/`` that are
    not in Hugging Face's files (the task's, such as NER's tag scheme), and which step's weights
    it holds; ``mode=predict`` reads the task's back (:func:`final_recipe`)."""
    (folder / RECIPE_FILE).write_text(json.dumps(recipe, indent=1, default=str) + "\n")


def final_recipe(model_dir: str | Path) -> dict[str, Any] | None:
    """What ``model_dir/recipe.json`` recorded (None for a model not written as a run's
    ``final/``, or by an earlier release)."""
    path = Path(model_dir).expanduser() / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path}: not readable JSON ({first_line_of(err)}); restore it from the run, or "
            "delete it to predict with the command line's settings."
        ) from None


def first_line_of(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def final_complete(output_dir: Path) -> bool:
    """Whether ``output_dir/final`` is a whole model folder: always so when written by this
    release (renamed when complete); one of an earlier release may lack its weights."""
    final = output_dir / FINAL
    if not (final / "config.json").is_file():
        return False
    return any(final.glob("*.safetensors")) or any(final.glob("*.bin"))


def remove_leftovers(output_dir: Path) -> list[str]:
    """Tidy what interrupted writes left in a run folder and its checkpoints: a complete
    checkpoint killed before its rename gets its name, and other ``.tmp-*`` / ``.del-*`` folders
    are removed. Call only while holding the run folder (nothing else writes there); returns
    what was done, for the log."""
    removed = []
    for written in checkpoints_dir(output_dir).glob(f".tmp-{PREFIX}*"):
        complete = written.with_name(written.name.removeprefix(".tmp-"))
        if (written / STATE_FILE).is_file() and not complete.exists():
            # Complete (the state file is written last) and killed before its rename: it
            # replaced a checkpoint of the same step, or was about to get its name.
            os.replace(written, complete)
            removed.append(f"restored {complete.name} (complete, stopped before its rename)")
    for folder in (output_dir, checkpoints_dir(output_dir)):
        if not folder.is_dir():
            continue
        for pattern in LEFTOVERS:
            for stale in folder.glob(pattern):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                    removed.append(
                        f"removed {stale.relative_to(output_dir)} (an interrupted write)"
                    )
    return removed


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
            discard(old)


def discard(folder: Path) -> None:
    """Remove a checkpoint (or ``final/``) so that no moment of it looks complete: first away
    from its name (one atomic rename), then file by file."""
    doomed = folder.with_name(f".del-{folder.name}")
    os.replace(folder, doomed)
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
    old, new = flatten(saved.config), flatten(config)
    ignore = ("output_dir", "resume")
    return sorted(
        k
        for k in set(old) | set(new)
        if old.get(k) != new.get(k) and not k.startswith(ignore) and k in old
    )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
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
