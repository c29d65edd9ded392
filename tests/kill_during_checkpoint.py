"""``python tests/kill_during_checkpoint.py STEP <train.py overrides>``: train.py, SIGKILLed in
the middle of writing the checkpoint of step STEP (after accelerate's files, before the files
that mark it complete), as a machine that dies mid-write leaves it.

The kill comes from here, by patching the checkpoint module's file-writing step, so that the
production code carries no test hook.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    step = int(sys.argv.pop(1))
    sys.path.insert(0, str(ROOT))
    from recipes import checkpoint

    write = checkpoint._write_loadable_files

    def write_or_die(folder: Path, model: Any, tokenizer: Any, state: Any) -> None:
        if state.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        write(folder, model, tokenizer, state)

    checkpoint._write_loadable_files = write_or_die
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")  # Hydra finds conf/ beside train.py


if __name__ == "__main__":
    main()
