"""``python tests/faults_during_run.py FAULT <train.py overrides>``: train.py with a fault that a
machine, not the code, brings, struck at a chosen moment:

* ``kill-in-final``: SIGKILL once ``final/``'s files are written, before they are published as
  ``final/`` (a node dying, or a launcher's SIGKILL after its grace period, mid-save);
* ``fill-disk``: another process fills the run folder's file system right after the free-space
  check of the second checkpoint, leaving 1 MiB (the write itself then fails);
* ``term-in-last-words``: SIGTERM while a causal LM's task writes its samples after training
  (after the final evaluation, before ``final/``).

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
    else:
        raise SystemExit(f"unknown fault {fault}")
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")  # Hydra finds conf/ beside train.py


if __name__ == "__main__":
    main()
