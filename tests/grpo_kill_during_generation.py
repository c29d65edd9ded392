"""``python tests/grpo_kill_during_generation.py CALL <train.py overrides>``: train.py, SIGKILLed
in the middle of its ``CALL``-th generation batch (counted from 1 over the run), as a node dies
while GRPO samples. The fault comes from here, by patching the generation module, so that the
production code carries no test hook."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    call = int(sys.argv.pop(1))
    sys.path.insert(0, str(ROOT))
    from recipes import generation

    original = generation.generate
    calls = {"n": 0}

    def generate_then_die(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        out = original(*args, **kwargs)
        if calls["n"] == call:  # the batch is generated, its answers not yet handed back
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    generation.generate = generate_then_die
    sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
