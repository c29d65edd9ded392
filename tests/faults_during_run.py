"""``python tests/faults_during_run.py FAULT <train.py overrides>``: train.py with a fault that a
machine, not the code, brings, struck at a chosen moment:

* ``kill-in-final``: SIGKILL once ``final/``'s files are written, before they are published as
  ``final/`` (a node dying, or a launcher's SIGKILL after its grace period, mid-save);
* ``fill-disk``: another process fills the run folder's file system right after the free-space
  check of the second checkpoint, leaving 1 MiB (the write itself then fails);
* ``term-in-last-words``: SIGTERM while a causal LM's task writes its samples after training
  (after the final evaluation, before ``final/``);
* ``full-after-checkpoint``: the disk is full for the main process's own files (metrics.jsonl,
  train.log, results.json, best.json, ...) right after the first checkpoint;
* ``full-after-final``: the same right after ``final/`` is saved (results.json cannot be written);
* ``gather-fails-on-main``: gathering the sharded model for ``final/`` fails on the main process
  only, while the others are inside the gather's collectives (a host out of memory there).

A full disk for files already open is the kernel's own: their descriptors are pointed at
``/dev/full``, where every write fails with ENOSPC; a file not yet written gets ENOSPC from a
patched ``open`` of the run folder's new files.

The faults come from here, by patching the checkpoint module, so that the production code carries
no test hook.
"""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    fault = sys.argv.pop(1)
    sys.path.insert(0, str(ROOT))
    from recipes import checkpoint

    if fault == "kill-in-final":
        save_final = checkpoint.save_final

        def killed_after_write(accelerator: Any, output_dir: Path, write: Any, need: int) -> Path:
            def write_then_die(folder: Path) -> None:
                write(folder)
                os.kill(os.getpid(), signal.SIGKILL)

            return save_final(accelerator, output_dir, write_then_die, need)

        checkpoint.save_final = killed_after_write
    elif fault == "fill-disk":
        check_space = checkpoint.check_space
        calls = []

        def check_then_fill(accelerator: Any, folder: Path, need: int, what: str) -> None:
            check_space(accelerator, folder, need, what)
            calls.append(what)
            if len(calls) == 2:
                filler = folder.parent.parent / "filler"
                free = shutil.disk_usage(folder).free
                with open(filler, "wb") as out:
                    out.truncate(0)
                    out.write(b"\0" * max(free - 2**20, 0))

        checkpoint.check_space = check_then_fill
    elif fault == "term-in-last-words":
        from recipes.tasks.lm import CausalLanguageModeling

        last_words = CausalLanguageModeling.after_training

        def signalled_then_last_words(self: Any, *args: Any) -> Any:
            os.kill(os.getpid(), signal.SIGTERM)
            return last_words(self, *args)

        CausalLanguageModeling.after_training = signalled_then_last_words
    elif fault in ("full-after-checkpoint", "full-after-final"):
        name = "save" if fault == "full-after-checkpoint" else "save_final"
        saved = getattr(checkpoint, name)

        def saved_then_full(accelerator: Any, output_dir: Path, *args: Any, **kwargs: Any) -> Any:
            path = saved(accelerator, output_dir, *args, **kwargs)
            if accelerator.is_main_process and not _full:
                _disk_full(Path(output_dir))
            return path

        setattr(checkpoint, name, saved_then_full)
    elif fault == "gather-fails-on-main":
        from accelerate import Accelerator

        gather = Accelerator.get_state_dict

        def fails_on_main(self: Any, model: Any, unwrap: bool = True) -> Any:
            if self.is_main_process:
                raise RuntimeError("gathering the model failed on this process only")
            return gather(self, model, unwrap)

        Accelerator.get_state_dict = fails_on_main
    else:
        raise SystemExit(f"unknown fault {fault}")
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")  # Hydra finds conf/ beside train.py


_full: list[Path] = []


def _disk_full(output_dir: Path) -> None:
    """From now on, every write of this process to a file of ``output_dir`` fails with ENOSPC:
    the files open for writing (metrics.jsonl, train.log) write to ``/dev/full``, and a file
    opened for writing there afterwards (results.json's temporary file, ...) is refused."""
    import builtins
    import errno
    import io
    import pathlib

    run = output_dir.resolve()
    _full.append(run)
    full = os.open("/dev/full", os.O_WRONLY)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if run in target.parents and target.suffix in (".jsonl", ".log"):
            os.dup2(full, int(fd))

    def refused(file: Any, mode: str) -> bool:
        writes = any(m in mode for m in "wax+")
        return (
            writes and isinstance(file, (str, os.PathLike)) and run in Path(file).resolve().parents
        )

    real_open = builtins.open

    def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if refused(file, mode):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = full_open  # type: ignore[assignment]
    real_path_open = pathlib.Path.open

    def full_path_open(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if refused(self, mode):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_path_open(self, mode, *args, **kwargs)

    pathlib.Path.open = full_path_open  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
